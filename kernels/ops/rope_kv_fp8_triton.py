"""Triton RoPE + fp8 KV write: ``rope_kv_triton``'s rotation, then each kv head's K and V
quantised in registers (``kv_fp8_triton``'s e4m3 arithmetic, a scale per token and head) and
stored as codes and scales. One program per (row, head) over q heads then kv heads; no host
read, so it is capturable in a CUDA graph.

Imported only when a Triton path runs (see ``kernels.ops._triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_codec import FP8_MAX
from kernels.ops._triton import next_power_of_2
from kernels.ops.kv_fp8_triton import e4m3_encode
from kernels.ops.rope_kv_triton import rope_head_row


@triton.jit
def _quantized_store(x, codes_dst, scale_dst, keep, keep_scale):
    """x (float32 row of one head, zeros past head_dim) -> codes and its scale."""
    scale = tl.max(tl.abs(x), axis=0) / FP8_MAX
    y = x / tl.where(scale > 0, scale, 1.0)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    tl.store(codes_dst, e4m3_encode(y), mask=keep)
    tl.store(scale_dst, scale, mask=keep_scale)


@triton.jit
def _rope_write_kv_fp8_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    q_ptr,
    qkv_stride,
    cos_stride,
    sin_stride,
    block_size,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
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
        slot = tl.maximum(slot, 0)  # a padding row computes, stores nothing (masks above)
        blk = slot // block_size
        off = slot % block_size
        base = ((blk * block_size + off) * NUM_KV_HEADS + kv_head).to(tl.int64)
        keep_scale = tl.load(slot_ptr + t) >= 0
        _quantized_store(
            tl.where(dmask, y.to(tl.float32), 0.0),
            k_ptr + base * HEAD_DIM + d,
            ks_ptr + base,
            keep,
            keep_scale,
        )
        v_col = (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v = tl.load(qkv_ptr + t * qkv_stride + v_col + d, mask=dmask, other=0.0).to(tl.float32)
        _quantized_store(v, v_ptr + base * HEAD_DIM + d, vs_ptr + base, keep, keep_scale)


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
    """Caches contiguous: codes [B, bs, nkv, hd] uint8, scales [B, bs, nkv] float32."""
    num_rows, head_dim = qkv.shape[0], k_cache.shape[-1]
    for t in (k_cache, v_cache, k_scale, v_scale):
        if not t.is_contiguous():
            raise ValueError("the fp8 write needs contiguous code and scale caches")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} for {num_heads} + 2 x {num_kv_heads} heads")
    q = qkv.new_empty((num_rows, num_heads, head_dim))
    if num_rows == 0:
        return q
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_write_kv_fp8_kernel[(num_rows, num_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        q,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.shape[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 64 else 2,
        enable_fp_fusion=False,
    )
    return q
