"""The LAST_EXITED exit copy on the device: a decode token that exits at loop e < D has its
plane-e K/V copied into its slots of planes e+1..D-1, in every layer.

Which rows exit is known on the device only, so the host sends every candidate pair
(source slot, destination slot) with the pass and the op copies the pairs whose ``mask`` is
set: no host round trip, and fixed shapes for a captured graph.
"""

from __future__ import annotations

import torch
from torch.library import Library

from kernels.ops._triton import triton_available

_lib = Library("rlt", "FRAGMENT")
_lib.define(
    "copy_kv_slots_masked(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src, Tensor dst, "
    "Tensor mask) -> ()"
)


def copy_kv_slots_masked_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    if src.numel() == 0:
        return
    layers, blocks, bs = k_cache.shape[:3]
    if mask.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous():
        # a host read is free on the CPU: copy only the pairs that exited, by flat slot
        keep = mask.nonzero().squeeze(1)
        if keep.numel() == 0:
            return
        source, target = src.long()[keep], dst.long()[keep]
        for cache in (k_cache, v_cache):
            flat = cache.view(layers, blocks * bs, -1)
            flat[:, target] = flat[:, source]
        return
    # an unmasked pair copies its destination onto itself: fixed shapes, no selection
    source = torch.where(mask, src, dst).long()
    target = dst.long()
    for cache in (k_cache, v_cache):
        cache[:, target // bs, target % bs] = cache[:, source // bs, source % bs]


_lib.impl("copy_kv_slots_masked", copy_kv_slots_masked_reference, "CPU")

if triton_available():
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

    def copy_kv_slots_masked_triton(
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

    _lib.impl("copy_kv_slots_masked", copy_kv_slots_masked_triton, "CUDA")
else:
    _lib.impl("copy_kv_slots_masked", copy_kv_slots_masked_reference, "CUDA")


def copy_kv_slots_masked(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """For every layer of [L, NB, bs, kvh, hd] caches: slot ``dst[i]`` := slot ``src[i]``
    where ``mask[i]``. Destinations are distinct; no destination is another pair's source."""
    torch.ops.rlt.copy_kv_slots_masked.default(k_cache, v_cache, src, dst, mask)
