"""``rlt::rope_write_kv_fp8``: ``rlt::rope_write_kv`` for a cache of the fp8 codec.

RoPE on q and k, then k and v quantised (``rlt::fp8_quantize``'s arithmetic: e4m3 codes and
one float32 scale per token and kv head) and scattered into the code caches and the scale
caches at ``slot_mapping``, in one op per layer: the pass keeps the launch count of ``auto``.
Rows whose slot is -1 are padding and are never written.
"""

from __future__ import annotations

import torch

from kernels.ops._triton import triton_available
from kernels.ops.kv_fp8 import fp8_quantize_reference
from kernels.ops.rope_kv import rope_qkv

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define(
    "rope_write_kv_fp8(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slot_mapping, "
    "int num_heads, int num_kv_heads) -> Tensor"
)


def rope_write_kv_fp8_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    head_dim = k_cache.shape[-1]
    q, k, v = rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    k_codes, k_s = fp8_quantize_reference(k)
    v_codes, v_s = fp8_quantize_reference(v)
    # Boolean selection syncs on CUDA: there the Triton kernel runs unless triton is missing
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = k_codes[keep]
    v_cache[blk, off] = v_codes[keep]
    k_scale[blk, off] = k_s[keep]
    v_scale[blk, off] = v_s[keep]
    return q.contiguous()


def rope_write_kv_fp8_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1)."""
    from kernels.ops import rope_kv_fp8_triton

    return rope_kv_fp8_triton.rope_write_kv_fp8(
        qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_heads, num_kv_heads
    )


def _rope_write_kv_fp8_cuda(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    impl = rope_write_kv_fp8_triton if triton_available() else rope_write_kv_fp8_reference
    return impl(
        qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_heads, num_kv_heads
    )


def _rope_write_kv_fp8_fake(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[-1]))


_lib.impl("rope_write_kv_fp8", rope_write_kv_fp8_reference, "CPU")
_lib.impl("rope_write_kv_fp8", _rope_write_kv_fp8_cuda, "CUDA")
torch.library.register_fake("rlt::rope_write_kv_fp8", _rope_write_kv_fp8_fake, lib=_lib)

_op = torch.ops.rlt.rope_write_kv_fp8.default


def rope_write_kv_fp8(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """As ``rope_write_kv``, into code caches [num_blocks, bs, nkv, hd] (uint8) and scale
    caches [num_blocks, bs, nkv] (float32). Returns the rotated q, contiguous [T, nh, hd]."""
    return _op(
        qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_heads, num_kv_heads
    )
