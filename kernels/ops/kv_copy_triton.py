"""Triton kernel of ``rlt::copy_kv_slots_masked``: one program per (pair, layer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(
    cache_ptr,
    src_ptr,
    dst_ptr,
    mask_ptr,
    layer_stride,
    slot_stride,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    if tl.load(mask_ptr + pair) != 0:
        src = tl.load(src_ptr + pair).to(tl.int64)
        dst = tl.load(dst_ptr + pair).to(tl.int64)
        base = cache_ptr + layer.to(tl.int64) * layer_stride
        for start in range(0, ROW, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            keep = offs < ROW
            values = tl.load(base + src * slot_stride + offs, mask=keep)
            tl.store(base + dst * slot_stride + offs, values, mask=keep)


def copy_kv_slots_masked(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """Caches [L, NB, bs, kvh, hd], each layer's slots contiguous rows of kvh * hd."""
    pairs = src.numel()
    if pairs == 0:
        return
    layers = k_cache.shape[0]
    row = k_cache.shape[3] * k_cache.shape[4]
    flags = mask.to(torch.int8)
    for cache in (k_cache, v_cache):
        assert cache.stride(2) == row and cache.stride(1) == row * cache.shape[2]
        _copy_kernel[(pairs, layers)](
            cache,
            src,
            dst,
            flags,
            cache.stride(0),
            row,
            ROW=row,
            BLOCK=min(1024, triton.next_power_of_2(row)),
        )
