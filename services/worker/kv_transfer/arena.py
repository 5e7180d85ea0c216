"""A worker's KV arenas as a transfer sees them, and the arithmetic of their descriptors:
one descriptor per block of each layer of each arena, each arena with its own block bytes
(a codec's scales are arenas of their own beside the codes). No NIXL here (``agent.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.kv_codec import AUTO, FP8, INT4_DELTA
from messages.kv_transfer import KVLayoutInfo, KVSourceInfo
from services.worker.kv_cache import PagedKV
from services.worker.kv_int4.paged import Int4KV

# how many tensors each codec keeps per block beside K and V
_EXTRAS = {AUTO: 0, FP8: 2, INT4_DELTA: 5}


@dataclass(frozen=True)
class KVArena:
    """One worker's KV tensors, each contiguous and ``[layers, blocks, ...]``: K and V
    ``[layers, blocks, block_size, heads, dim]`` (codes under a codec), then the codec's
    other per-block tensors (``extras``): under fp8 the float32 scales ``[layers, blocks,
    block_size, heads]``; under int4-delta the K scale and zero point per channel, the V
    scale and zero point per token and group, and the ``stored`` flags. A code means
    nothing without them, so all move."""

    k: torch.Tensor
    v: torch.Tensor
    extras: tuple[torch.Tensor, ...] = ()
    codec: str = AUTO
    int4_anchor_every: int = 0  # int4-delta: which planes' codes are deltas

    def __post_init__(self) -> None:
        want = _EXTRAS.get(self.codec)
        if want is None or len(self.extras) != want:
            raise ValueError(
                f"KV arena: codec {self.codec} with {len(self.extras)} tensors beside K and V"
            )

    @classmethod
    def of(cls, kv: PagedKV | Int4KV) -> KVArena:
        """The arena of a worker's KV: its codes and the codec's scales (int4-delta: its
        sealed blocks' fields; the full-precision tails of open blocks are not moved)."""
        if isinstance(kv, Int4KV):
            s = kv.store
            extras = (s.k_scale, s.k_zero, s.v_scale, s.v_zero, s.stored)
            return cls(s.k_codes, s.v_codes, extras, INT4_DELTA, kv.anchor_every)
        if kv.k_scale is None or kv.v_scale is None:
            return cls(kv.k, kv.v, (), kv.codec)
        return cls(kv.k, kv.v, (kv.k_scale, kv.v_scale), kv.codec)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, *self.extras]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_bytes(self) -> int:
        """Bytes of one K (or V) block of one layer."""
        return self.k[0, 0].numel() * self.k.element_size()

    @property
    def arena_block_bytes(self) -> list[int]:
        """Bytes of one block of one layer, per tensor (``tensors``' order)."""
        return [t[0, 0].numel() * t.element_size() for t in self.tensors]

    @property
    def addresses(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors]

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.k.device.type == "cpu" else "VRAM"

    @property
    def device_id(self) -> int:
        return 0 if self.k.device.type == "cpu" else self.k.device.index or 0

    def layout(self, kv_layout: str, num_planes: int) -> KVLayoutInfo:
        _, _, block_size, heads, dim = self.k.shape
        if self.codec == INT4_DELTA:
            dim *= 2  # two 4-bit codes a byte
        return KVLayoutInfo(
            kv_layout=kv_layout,
            block_size=block_size,
            num_planes=num_planes,
            num_layers=self.num_layers,
            num_kv_heads=heads,
            head_dim=dim,
            kv_cache_dtype=self.codec,
            kv_int4_anchor_every=self.int4_anchor_every,
            dtype=str(self.k.dtype).removeprefix("torch."),
        )


def block_table(
    addresses: list[int],
    num_blocks: int,
    num_layers: int,
    block_bytes: int | list[int],
    device_id: int,
) -> np.ndarray:
    """Nx3 ``(address, length, device)``: one descriptor per block of each layer of each
    arena; block b of layer l of arena a is row ``(a * num_layers + l) * num_blocks + b``.
    ``block_bytes``: one for every arena, or one per arena."""
    sizes = np.broadcast_to(np.asarray(block_bytes, dtype=np.uint64), (len(addresses),))
    per_block = sizes[:, None, None]
    bases = np.asarray(addresses, dtype=np.uint64)[:, None, None]
    layers = np.arange(num_layers, dtype=np.uint64)[None, :, None] * (
        np.uint64(num_blocks) * per_block
    )
    blocks = np.arange(num_blocks, dtype=np.uint64)[None, None, :] * per_block
    starts = (bases + layers + blocks).reshape(-1)
    rows = np.empty((starts.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 2] = starts, device_id
    rows[:, 1] = np.broadcast_to(per_block, (len(addresses), num_layers, num_blocks)).reshape(-1)
    return rows


def source_block_bytes(source: KVSourceInfo) -> list[int]:
    """Bytes of one block of one layer per arena of a source (one that does not say:
    ``block_bytes`` for each)."""
    return list(source.arena_block_bytes) or [source.block_bytes] * len(source.arena_addresses)


def block_indices(
    blocks: list[int], num_arenas: int, num_layers: int, num_blocks: int
) -> np.ndarray:
    """Rows of ``block_table`` for ``blocks`` in every layer of every arena, arena-major,
    then layer, then the blocks in order: the same order on both sides, so index i of the
    local list pairs with index i of the remote one."""
    lanes = np.arange(num_arenas * num_layers, dtype=np.int64)[:, None] * num_blocks
    return (lanes + np.asarray(blocks, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)


def split_indices(
    local: np.ndarray, remote: np.ndarray, block_bytes: int, chunk_bytes: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Paired block indices in chunks of at most ``chunk_bytes`` (at least one block)."""
    per_chunk = max(1, chunk_bytes // block_bytes)
    return [
        (local[i : i + per_chunk], remote[i : i + per_chunk])
        for i in range(0, local.size, per_chunk)
    ]
