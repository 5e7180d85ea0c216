"""The worker's paged KV storage under one codec (``kernels/kv_codec.py``): the tensors one
layer's blocks are made of, for every layer, and the slot copies that move all of them.

``auto`` is K and V in the model's dtype. ``fp8`` is K and V as e4m3 codes (uint8) plus a
float32 scale per (slot, kv head): written by ``rlt::rope_write_kv_fp8``, read by
``rlt::paged_attention`` with its scales. ``int4-delta`` has its own storage
(``services/worker/kv_int4/``): codes, scales and full-precision tails.
"""

from __future__ import annotations

import torch

from kernels.kv_codec import AUTO, FP8, INT4_DELTA, block_bytes
from kernels.ops import copy_kv_slots_masked


def check_storable(codec: str) -> None:
    """Raises ValueError for a codec the worker cannot store."""
    if codec not in (AUTO, FP8, INT4_DELTA):
        raise ValueError(f"unknown kv cache dtype {codec!r}")


class PagedKV:
    """K/V of every layer, [L, blocks, block_size, kv_heads, head_dim], and (fp8) their
    scales [L, blocks, block_size, kv_heads]."""

    def __init__(
        self,
        codec: str,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if codec not in (AUTO, FP8):
            raise ValueError(
                f"PagedKV stores auto and fp8, not {codec!r} (int4-delta: services/worker/kv_int4)"
            )
        self.codec = codec
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        # fp8 codes are one byte; the attention kernels decode them as they load a tile
        code_dtype = torch.uint8 if codec == FP8 else dtype
        self.k = torch.zeros(shape, dtype=code_dtype, device=device)
        self.v = torch.zeros(shape, dtype=code_dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if codec == FP8:
            self.k_scale = torch.zeros(shape[:4], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:4], dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        """Device bytes of every tensor (codes and scales)."""
        tensors = [self.k, self.v, self.k_scale, self.v_scale]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor) -> None:
        """Copies slot ``src[i]`` onto ``dst[i]`` in every layer where ``mask[i]``: codes and,
        under fp8, their scales (a code means nothing without its scale)."""
        copy_kv_slots_masked(self.k, self.v, src, dst, mask)
        if self.k_scale is not None and self.v_scale is not None:
            # a scale is a one-channel "head": the same copy op moves it
            ks, vs = self.k_scale.unsqueeze(-1), self.v_scale.unsqueeze(-1)
            copy_kv_slots_masked(ks, vs, src, dst, mask)


def bytes_per_block(
    codec: str, layers: int, block_size: int, kv_heads: int, head_dim: int, model_bytes: int
) -> int:
    """Device bytes one block id takes over every layer (K, V and scales)."""
    return layers * block_bytes(codec, block_size, kv_heads, head_dim, model_bytes)
