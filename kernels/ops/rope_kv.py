"""``rlt::rope_write_kv``: RoPE on q and k from the fused qkv output, and the KV cache write.

One op per layer replaces the split / view / rotate / index_put sequence. Rows whose slot is
-1 are padding: rotated like the rest but never written to the cache.
"""

from __future__ import annotations

import torch

from kernels.ops._triton import triton_available

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define(
    "rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor"
)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotated q [T, nh, hd], rotated k [T, nkv, hd], v [T, nkv, hd]) of qkv (views)."""
    num_rows = qkv.shape[0]
    kv_dim = num_kv_heads * head_dim
    q_dim = num_heads * head_dim
    # q and k rotate together: one set of elementwise ops over their heads
    qk = qkv[:, : q_dim + kv_dim].view(num_rows, num_heads + num_kv_heads, head_dim)
    c, s = cos[:, None, :], sin[:, None, :]
    qk = qk * c + _rotate_half(qk) * s
    v = qkv[:, q_dim + kv_dim :].view(num_rows, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


def rope_write_kv_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    head_dim = k_cache.shape[-1]
    q, k, v = rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    if slot_mapping.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous():
        # a host read is free on the CPU: write every row at once unless some are padding
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping.long()] = k.to(k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping.long()] = v.to(v_cache.dtype)
        return q.contiguous()
    # Boolean indexing syncs on CUDA; this path only runs there when triton is missing.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = k[keep].to(k_cache.dtype)
    v_cache[blk, off] = v[keep].to(v_cache.dtype)
    return q.contiguous()


def rope_write_kv_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1)."""
    from kernels.ops import rope_kv_triton

    return rope_kv_triton.rope_write_kv(
        qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
    )


def _rope_write_kv_cuda(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    impl = rope_write_kv_triton if triton_available() else rope_write_kv_reference
    return impl(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def _rope_write_kv_fake(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[-1]))


_lib.impl("rope_write_kv", rope_write_kv_reference, "CPU")
_lib.impl("rope_write_kv", _rope_write_kv_cuda, "CUDA")
torch.library.register_fake("rlt::rope_write_kv", _rope_write_kv_fake, lib=_lib)

_rope_write_kv_op = torch.ops.rlt.rope_write_kv.default


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k of qkv [T, (nh + 2 nkv) hd] by cos/sin [T, hd] and write k, v into the
    one-layer caches [num_blocks, block_size, nkv, hd] at ``slot_mapping`` [T] (int64 or int32;
    -1 skips the row). Returns the rotated q, contiguous [T, nh, hd]."""
    return _rope_write_kv_op(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
