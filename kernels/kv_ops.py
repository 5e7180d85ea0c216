"""KV cache writes by slot mapping and the LAST_EXITED exit copy.

A slot is ``block_id * block_size + offset``; caches are indexed as ``[block, offset]`` so any
cache strides work without flattening (and copying) the whole block pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Physical slot of ``position`` under ``block_table``."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    index = position // block_size
    if index >= len(block_table):
        raise ValueError(
            f"block table of {len(block_table)} blocks does not cover position {position} "
            f"(block_size {block_size})"
        )
    return int(block_table[index]) * block_size + position % block_size


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new rows in place.

    One-layer caches [num_blocks, block_size, kvh, hd]; k/v [T, kvh, hd]; slot_mapping [T].
    """
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} disagree"
        )
    if k.shape[0] == 0:
        return
    bs = k_cache.shape[1]
    blk, off = slot_mapping // bs, slot_mapping % bs
    k_cache[blk, off] = k.to(k_cache.dtype)
    v_cache[blk, off] = v.to(v_cache.dtype)


def copy_kv_slots(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """For every layer of [L, num_blocks, block_size, kvh, hd] caches set slot dst[i] := src[i].

    Sources are gathered before anything is written, so src/dst may overlap; destinations
    should be distinct (duplicates make the winner unspecified).
    """
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} "
            "must be equal-length 1-D tensors"
        )
    if src_slots.numel() == 0:
        return
    bs = k_cache.shape[2]
    src_blk, src_off = src_slots // bs, src_slots % bs
    dst_blk, dst_off = dst_slots // bs, dst_slots % bs
    for cache in (k_cache, v_cache):
        # Advanced indexing on the right-hand side materialises a copy first.
        cache[:, dst_blk, dst_off] = cache[:, src_blk, src_off]


def exit_copy_slots(
    block_tables_by_plane: Sequence[Sequence[int]],
    position: int,
    exit_plane: int,
    block_size: int,
) -> tuple[list[int], list[int]]:
    """(src, dst) slots propagating one exited token's KV from ``exit_plane`` to later planes.

    Under LAST_EXITED a token exiting at depth e < D-1 must look, to later queries at deeper
    depths, as if its depth-e KV were its final KV, so its slot in plane e is copied into its
    slots in planes e+1..D-1. Exiting at the last plane needs no copy (empty lists).
    """
    num_planes = len(block_tables_by_plane)
    if not 0 <= exit_plane < num_planes:
        raise ValueError(f"exit_plane {exit_plane} out of range for {num_planes} planes")
    src = slot_of(block_tables_by_plane[exit_plane], position, block_size)
    dst = [
        slot_of(block_tables_by_plane[p], position, block_size)
        for p in range(exit_plane + 1, num_planes)
    ]
    return [src] * len(dst), dst
