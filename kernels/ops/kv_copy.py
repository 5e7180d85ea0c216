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


def copy_kv_slots_masked_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1)."""
    from kernels.ops import kv_copy_triton

    kv_copy_triton.copy_kv_slots_masked(k_cache, v_cache, src, dst, mask)


def _copy_kv_slots_masked_cuda(*args: torch.Tensor) -> None:
    if triton_available():
        copy_kv_slots_masked_triton(*args)
    else:
        copy_kv_slots_masked_reference(*args)


def _copy_kv_slots_masked_fake(*args: torch.Tensor) -> None:
    return None


_lib.impl("copy_kv_slots_masked", _copy_kv_slots_masked_cuda, "CUDA")
torch.library.register_fake("rlt::copy_kv_slots_masked", _copy_kv_slots_masked_fake, lib=_lib)
_copy_kv_slots_masked_op = torch.ops.rlt.copy_kv_slots_masked.default


def copy_kv_slots_masked(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """For every layer of [L, NB, bs, kvh, hd] caches: slot ``dst[i]`` := slot ``src[i]``
    where ``mask[i]``. Destinations are distinct; no destination is another pair's source."""
    _copy_kv_slots_masked_op(k_cache, v_cache, src, dst, mask)
