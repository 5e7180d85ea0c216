"""Triton RoPE + KV cache write: one program per (row, head) over q heads then kv heads.

Imported only when a Triton path runs (see ``kernels.ops._triton``). Each product and the sum
round to the model dtype as the reference's separate torch ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops._triton import next_power_of_2


@triton.jit
def rope_head_row(
    qkv_ptr, cos_ptr, sin_ptr, t, head, qkv_stride, cos_stride, sin_stride, d, dmask, HEAD_DIM
):
    """Head ``head`` of token ``t``'s qkv row, rotated (split-half RoPE) in the model dtype,
    rounded step by step as the reference's torch ops are."""
    # rotate_half(x)[d] = -x[d + hd/2] in the first half, x[d - hd/2] in the second.
    first = d < HEAD_DIM // 2
    partner = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
    sign = tl.where(first, -1.0, 1.0)
    c = tl.load(cos_ptr + t * cos_stride + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sin_stride + d, mask=dmask, other=0.0).to(tl.float32)
    row = qkv_ptr + t * qkv_stride
    x = tl.load(row + head * HEAD_DIM + d, mask=dmask, other=0.0)
    xp = tl.load(row + head * HEAD_DIM + partner, mask=dmask, other=0.0)
    dt = x.dtype
    a = (x.to(tl.float32) * c).to(dt)
    b = (xp.to(tl.float32) * sign * s).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    q_ptr,
    qkv_stride,
    cos_stride,
    sin_stride,
    k_s0,
    k_s1,
    k_s2,
    k_s3,
    v_s0,
    v_s1,
    v_s2,
    v_s3,
    block_size,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then kv heads: k's columns follow q's in qkv
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    y = rope_head_row(
        qkv_ptr, cos_ptr, sin_ptr, t, head, qkv_stride, cos_stride, sin_stride, d, dmask, HEAD_DIM
    )
    if head < NUM_HEADS:
        tl.store(q_ptr + (t * NUM_HEADS + head) * HEAD_DIM + d, y, mask=dmask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # Broadcast before the &: the interpreter mis-types scalar & vector masks.
        keep = dmask & (d * 0 + slot >= 0)
        blk = slot // block_size
        off = slot % block_size
        k_dst = k_ptr + blk * k_s0 + off * k_s1 + kv_head * k_s2 + d * k_s3
        tl.store(k_dst, y.to(k_ptr.dtype.element_ty), mask=keep)
        v_col = (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v = tl.load(qkv_ptr + t * qkv_stride + v_col + d, mask=dmask, other=0.0)
        v_dst = v_ptr + blk * v_s0 + off * v_s1 + kv_head * v_s2 + d * v_s3
        tl.store(v_dst, v.to(v_ptr.dtype.element_ty), mask=keep)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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
    num_rows, head_dim = qkv.shape[0], k_cache.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {num_heads} q and 2 x {num_kv_heads} kv "
            f"heads of {head_dim}"
        )
    if head_dim % 2 or cos.shape != (num_rows, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} for {num_rows} rows")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    q = qkv.new_empty((num_rows, num_heads, head_dim))
    if num_rows == 0:
        return q
    qkv, cos, sin = _unit_last(qkv), _unit_last(cos), _unit_last(sin)
    _rope_write_kv_kernel[(num_rows, num_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        q,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        *k_cache.stride(),
        *v_cache.stride(),
        k_cache.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 64 else 2,
        # Separate roundings of q*cos and rot(q)*sin, as the reference's torch ops do.
        enable_fp_fusion=False,
    )
    return q
