"""Torch reference paged attention over packed rows from many segments.

A core pass packs rows (tokens) of several requests at different loop depths. Rows are grouped
into segments: a contiguous run of rows of one request at one depth, i.e. query positions
``pos_start .. pos_start + num_rows - 1`` reading one KV plane through that plane's block table.
Each query attends causally over positions ``[0, its position]`` of its own segment's plane.

The metadata is built once per core pass (Python work per segment happens only there) and every
layer reuses it, so ``paged_attention`` itself is a handful of batched tensor ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """Contiguous rows of one request at one depth in the packed batch."""

    row_start: int
    num_rows: int
    pos_start: int
    block_table: Sequence[int]


@dataclass
class AttentionMetadata:
    """Per-pass index tensors shared by all layers.

    Segments are stored sorted by ``row_start`` (S of them, padded to Qmax query rows and Cmax
    context positions). Padding always points at real, already-written data of the same segment
    so that uninitialised (possibly NaN) cache memory is never multiplied in, even by zero.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot receiving each row's new K/V
    positions: torch.Tensor  # [T] int64: query position of each row (e.g. for RoPE)
    query_rows: torch.Tensor  # [S, Qmax] int64: packed row of each segment query (pad: 1st row)
    context_slots: torch.Tensor  # [S, Cmax] int64: slot of each context position (pad: pos 0)
    context_lens: torch.Tensor  # [S] int64: pos_start + num_rows of each segment
    mask: torch.Tensor  # [S, Qmax, Cmax] bool: causal; padded queries copy the last real row
    row_to_padded: torch.Tensor  # [T] int64: index of each row in the flattened [S * Qmax] grid
    block_size: int
    num_rows: int
    max_block_id: int  # largest block id referenced; lets kernels check cache size sync-free

    @property
    def num_segments(self) -> int:
        return int(self.query_rows.shape[0])


def _validate(segments: Sequence[Segment], block_size: int, num_rows: int) -> list[Segment]:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    for seg in segments:
        if seg.num_rows < 1:
            raise ValueError(f"segment {seg} has num_rows < 1")
        if seg.pos_start < 0 or seg.row_start < 0:
            raise ValueError(f"segment {seg} has a negative row_start or pos_start")
        needed = -(-(seg.pos_start + seg.num_rows) // block_size)
        if len(seg.block_table) < needed:
            raise ValueError(
                f"block table too short for segment at row {seg.row_start}: positions up to "
                f"{seg.pos_start + seg.num_rows - 1} need {needed} blocks of {block_size}, "
                f"table has {len(seg.block_table)}"
            )
        if any(b < 0 for b in seg.block_table[:needed]):
            raise ValueError(f"negative block id in table of segment at row {seg.row_start}")
    ordered = sorted(segments, key=lambda s: s.row_start)
    expected = 0
    for seg in ordered:
        if seg.row_start < expected:
            raise ValueError(
                f"segments overlap: segment at row {seg.row_start} starts before row {expected}"
            )
        if seg.row_start > expected:
            raise ValueError(
                f"segments leave a gap: rows {expected}..{seg.row_start - 1} uncovered"
            )
        expected += seg.num_rows
    if expected != num_rows:
        if expected > num_rows:
            raise ValueError(f"segments cover {expected} rows but the batch has {num_rows}")
        raise ValueError(f"segments leave a gap: rows {expected}..{num_rows - 1} uncovered")
    return ordered


def build_attention_metadata(
    segments: Sequence[Segment],
    block_size: int,
    num_rows: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Validate the segment layout and build all index tensors for one core pass."""
    ordered = _validate(segments, block_size, num_rows)
    num_segs = len(ordered)
    ctx_lens_list = [s.pos_start + s.num_rows for s in ordered]
    blocks_needed = [-(-c // block_size) for c in ctx_lens_list]
    q_max = max((s.num_rows for s in ordered), default=0)
    c_max = max(ctx_lens_list, default=0)
    b_max = max(blocks_needed, default=0)
    # Only the used prefix of each table matters; pad with its first block (never selected).
    tables_list = [
        list(s.block_table[:n]) + [s.block_table[0]] * (b_max - n)
        for s, n in zip(ordered, blocks_needed, strict=True)
    ]
    max_block_id = max((max(t) for t in tables_list), default=-1)

    i64 = torch.int64
    tables = torch.tensor(tables_list, dtype=i64, device=device).reshape(num_segs, b_max)
    row_start = torch.tensor([s.row_start for s in ordered], dtype=i64, device=device)
    seg_rows = torch.tensor([s.num_rows for s in ordered], dtype=i64, device=device)
    pos_start = torch.tensor([s.pos_start for s in ordered], dtype=i64, device=device)
    ctx_lens = torch.tensor(ctx_lens_list, dtype=i64, device=device)

    # Per-row view: sorted segments tile rows 0..T-1 in order.
    seg_of_row = torch.repeat_interleave(torch.arange(num_segs, device=device), seg_rows)
    rows = torch.arange(num_rows, dtype=i64, device=device)
    offset_in_seg = rows - row_start[seg_of_row]
    positions = pos_start[seg_of_row] + offset_in_seg
    slot_mapping = tables[seg_of_row, positions // block_size] * block_size + positions % block_size
    row_to_padded = seg_of_row * q_max + offset_in_seg

    # Padded per-segment grids. Clamping padding to the last real query / position 0 keeps
    # every softmax row non-empty and every gathered K/V slot a written one.
    q_idx = torch.arange(q_max, dtype=i64, device=device)
    q_clamped = torch.minimum(q_idx[None, :], seg_rows[:, None] - 1)  # [S, Qmax]
    query_rows = row_start[:, None] + q_clamped
    c_idx = torch.arange(c_max, dtype=i64, device=device)
    c_valid = c_idx[None, :] < ctx_lens[:, None]  # [S, Cmax]
    c_pos = torch.where(c_valid, c_idx[None, :], torch.zeros_like(c_idx)[None, :])
    context_slots = torch.gather(tables, 1, c_pos // block_size) * block_size + c_pos % block_size
    q_pos = pos_start[:, None] + q_clamped  # [S, Qmax]
    mask = c_idx[None, None, :] <= q_pos[:, :, None]  # implies c < ctx_len

    return AttentionMetadata(
        slot_mapping=slot_mapping,
        positions=positions,
        query_rows=query_rows,
        context_slots=context_slots,
        context_lens=ctx_lens,
        mask=mask,
        row_to_padded=row_to_padded,
        block_size=block_size,
        num_rows=num_rows,
        max_block_id=max_block_id,
    )


def check_cache_shape(
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Raise if one-layer caches cannot serve ``meta`` (cheap: no device sync)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "expected one-layer caches [num_blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"cache block_size {k_cache.shape[1]} != metadata {meta.block_size}")
    if meta.max_block_id >= k_cache.shape[0]:
        raise ValueError(f"block id {meta.max_block_id} out of range for {k_cache.shape[0]} blocks")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries over their segments' paged K/V.

    q: [T, H, hd]; k_cache / v_cache: one layer [num_blocks, block_size, kvh, hd] that already
    hold this pass's new K/V (see ``write_kv``). Returns [T, H, hd] in ``q.dtype``.
    """
    num_rows, num_heads, head_dim = q.shape
    if num_rows != meta.num_rows:
        raise ValueError(f"q has {num_rows} rows but metadata was built for {meta.num_rows}")
    check_cache_shape(k_cache, v_cache, meta)
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {kv_heads}")
    if num_rows == 0:
        return q.new_empty((0, num_heads, head_dim))
    group = num_heads // kv_heads
    num_segs, q_max = meta.query_rows.shape
    c_max = meta.context_slots.shape[1]
    # Float32 at least for the softmax; float64 inputs stay float64.
    acc = torch.promote_types(q.dtype, torch.float32)

    bs = meta.block_size
    # Two-index gather works for any cache strides (no flatten copy of the whole pool).
    blk, off = meta.context_slots // bs, meta.context_slots % bs
    keys = k_cache[blk, off].to(acc)  # [S, Cmax, kvh, hd]
    vals = v_cache[blk, off].to(acc)

    # GQA without repeating K/V: fold the query group into the query axis per kv head.
    qs = q[meta.query_rows].to(acc)  # [S, Qmax, H, hd]
    qs = qs.view(num_segs, q_max, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(num_segs, kv_heads, group * q_max, head_dim)
    scores = torch.matmul(qs, keys.permute(0, 2, 3, 1)) * scale  # [S, kvh, G*Qmax, Cmax]
    scores = scores.view(num_segs, kv_heads, group, q_max, c_max)
    scores = scores.masked_fill(~meta.mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_segs, kv_heads, group * q_max, c_max)
    out = torch.matmul(probs, vals.permute(0, 2, 1, 3))  # [S, kvh, G*Qmax, hd]
    out = out.view(num_segs, kv_heads, group, q_max, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_segs * q_max, num_heads, head_dim)
    return out[meta.row_to_padded].to(q.dtype)
