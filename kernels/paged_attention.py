"""Torch reference paged attention over packed rows from many segments.

A core pass packs rows (tokens) of several requests at different loop depths. Rows are grouped
into segments: a contiguous run of rows of one request at one depth, i.e. query positions
``pos_start .. pos_start + num_rows - 1`` reading one KV plane through that plane's block table.
Each query attends causally over positions ``[0, its position]`` of its own segment's plane.

The metadata is built once per core pass (Python work per segment happens only there) and every
layer reuses it, so ``paged_attention`` itself is a handful of batched tensor ops per bucket:
segments are grouped by query length so 1-row decode segments are not padded to the length of
a prefill chunk sharing their pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """Contiguous rows of one request at one depth in the packed batch."""

    row_start: int
    num_rows: int
    pos_start: int
    block_table: Sequence[int]


# Padded (query, context) pairs a bucket boundary must save to be worth one more bucket: each
# bucket costs ~a dozen extra small tensor ops per layer, about as much as this many pairs.
_MERGE_SLACK = 4096


@dataclass(frozen=True)
class AttentionBucket:
    """Segments of similar query length, padded only to this bucket's own Qb x Cb grid.

    Padding always points at real, already-written data of the same segment so that
    uninitialised (possibly NaN) cache memory is never multiplied in, even by zero.
    """

    query_rows: torch.Tensor  # [Sb, Qb] int64: packed row of each segment query (pad: last row)
    context_slots: torch.Tensor  # [Sb, Cb] int64: slot of each context position (pad: pos 0)
    mask: torch.Tensor  # [Sb, Qb, Cb] bool: causal; padded queries copy the last real row
    num_rows: int  # real (unpadded) rows in this bucket

    @property
    def num_segments(self) -> int:
        return int(self.query_rows.shape[0])

    @property
    def q_max(self) -> int:
        return int(self.query_rows.shape[1])

    @property
    def c_max(self) -> int:
        return int(self.context_slots.shape[1])


@dataclass
class _GridInputs:
    """Per-segment tensors (sorted by row_start) kept to build the full grid on demand."""

    tables: torch.Tensor  # [S, Bmax]
    row_start: torch.Tensor
    seg_rows: torch.Tensor
    pos_start: torch.Tensor
    seg_of_row: torch.Tensor  # [T]
    offset_in_seg: torch.Tensor  # [T]
    q_max: int
    c_max: int


@dataclass
class AttentionMetadata:
    """Per-pass index tensors shared by all layers.

    Segments are sorted by ``row_start`` and grouped into ``buckets`` by query length, so a
    pass mixing 1-row decode segments with 64-row prefill chunks does not pad every decode row
    to 64 queries. Kernels run once per bucket; output row t is row ``row_to_bucketed[t]`` of
    the buckets' flattened [Sb * Qb] grids concatenated in order.

    ``query_rows`` / ``context_slots`` / ``mask`` / ``row_to_padded`` describe the one full
    [S, Qmax, Cmax] grid over all segments (used by the flash backend); with a single bucket
    they are that bucket's tensors, otherwise they are built lazily on first access.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot receiving each row's new K/V
    positions: torch.Tensor  # [T] int64: query position of each row (e.g. for RoPE)
    context_lens: torch.Tensor  # [S] int64: pos_start + num_rows of each segment
    buckets: tuple[AttentionBucket, ...]
    row_to_bucketed: torch.Tensor  # [T] int64: index into the concatenated bucket grids
    block_size: int
    num_rows: int
    max_block_id: int  # largest block id referenced; lets kernels check cache size sync-free
    _grid_inputs: _GridInputs | None = field(default=None, repr=False)
    _full: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _full_mask: torch.Tensor | None = field(default=None, repr=False)
    _row_to_padded: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_segments(self) -> int:
        return int(self.context_lens.shape[0])

    def _full_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.buckets) == 1:
            return self.buckets[0].query_rows, self.buckets[0].context_slots
        if self._full is None:
            g = self._grid_inputs
            assert g is not None, "multi-bucket metadata without grid inputs"
            self._full = _query_and_context_grid(
                g.tables,
                g.row_start,
                g.seg_rows,
                self.context_lens,
                g.q_max,
                g.c_max,
                self.block_size,
            )
        return self._full

    @property
    def query_rows(self) -> torch.Tensor:  # [S, Qmax]
        return self._full_grid()[0]

    @property
    def context_slots(self) -> torch.Tensor:  # [S, Cmax]
        return self._full_grid()[1]

    @property
    def mask(self) -> torch.Tensor:  # [S, Qmax, Cmax]
        if len(self.buckets) == 1:
            return self.buckets[0].mask
        if self._full_mask is None:
            g = self._grid_inputs
            assert g is not None, "multi-bucket metadata without grid inputs"
            self._full_mask = _causal_mask(g.pos_start, g.seg_rows, g.q_max, g.c_max)
        return self._full_mask

    @property
    def row_to_padded(self) -> torch.Tensor:  # [T]: index in the flattened [S * Qmax] grid
        if len(self.buckets) == 1:
            return self.row_to_bucketed
        if self._row_to_padded is None:
            g = self._grid_inputs
            assert g is not None, "multi-bucket metadata without grid inputs"
            self._row_to_padded = g.seg_of_row * g.q_max + g.offset_in_seg
        return self._row_to_padded


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


def _query_and_context_grid(
    tables: torch.Tensor,
    row_start: torch.Tensor,
    seg_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_max: int,
    c_max: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, Qmax] packed query rows and [S, Cmax] context slots of a padded segment grid.

    Clamping padding to the last real query / position 0 keeps every softmax row non-empty
    and every gathered K/V slot a written one.
    """
    dev = tables.device
    q_idx = torch.arange(q_max, dtype=torch.int64, device=dev)
    q_clamped = torch.minimum(q_idx[None, :], seg_rows[:, None] - 1)
    query_rows = row_start[:, None] + q_clamped
    c_idx = torch.arange(c_max, dtype=torch.int64, device=dev)
    c_pos = torch.where(c_idx[None, :] < ctx_lens[:, None], c_idx[None, :], 0)
    blocks = torch.gather(tables, 1, torch.div(c_pos, block_size, rounding_mode="floor"))
    return query_rows, blocks * block_size + c_pos % block_size


def _causal_mask(
    pos_start: torch.Tensor, seg_rows: torch.Tensor, q_max: int, c_max: int
) -> torch.Tensor:
    """[S, Qmax, Cmax] bool: query i (clamped to the last real one) sees positions <= its own."""
    dev = pos_start.device
    q_idx = torch.arange(q_max, dtype=torch.int64, device=dev)
    q_pos = pos_start[:, None] + torch.minimum(q_idx[None, :], seg_rows[:, None] - 1)
    c_idx = torch.arange(c_max, dtype=torch.int64, device=dev)
    return c_idx[None, None, :] <= q_pos[:, :, None]  # implies c < ctx_len


def _padded_cost(seg_idx: list[int], rows: list[int], ctx: list[int]) -> int:
    return len(seg_idx) * max(rows[i] for i in seg_idx) * max(ctx[i] for i in seg_idx)


def bucket_segments(rows: list[int], ctx_lens: list[int]) -> list[list[int]]:
    """Group segment indices into buckets of similar query length.

    Size classes are powers of two of the row count (1, 2, 3-4, 5-8, ...); neighbouring
    classes merge while merging wastes fewer than ``_MERGE_SLACK`` padded (query, context)
    pairs, so uniform passes (all decode, all same-size chunks) stay one bucket. Each bucket
    lists its segments in ascending index order.
    """
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(rows):
        classes.setdefault((n - 1).bit_length(), []).append(i)
    if len(classes) <= 1:
        return [list(range(len(rows)))]
    buckets: list[list[int]] = []
    for key in sorted(classes):
        group = classes[key]
        if buckets:
            merged = buckets[-1] + group
            waste = (
                _padded_cost(merged, rows, ctx_lens)
                - _padded_cost(buckets[-1], rows, ctx_lens)
                - _padded_cost(group, rows, ctx_lens)
            )
            if waste < _MERGE_SLACK:
                buckets[-1] = merged
                continue
        buckets.append(group)
    return [sorted(b) for b in buckets]


def build_attention_metadata(
    segments: Sequence[Segment],
    block_size: int,
    num_rows: int,
    device: torch.device | str = "cpu",
    bucketed: bool = True,
) -> AttentionMetadata:
    """Validate the segment layout and build all index tensors for one core pass.

    ``bucketed=False`` forces a single bucket (the full padded grid); it exists for
    benchmarks and tests that compare against the unbucketed kernel.
    """
    ordered = _validate(segments, block_size, num_rows)
    num_segs = len(ordered)
    rows_list = [s.num_rows for s in ordered]
    ctx_lens_list = [s.pos_start + s.num_rows for s in ordered]
    blocks_needed = [-(-c // block_size) for c in ctx_lens_list]
    q_max = max(rows_list, default=0)
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
    seg_rows = torch.tensor(rows_list, dtype=i64, device=device)
    pos_start = torch.tensor([s.pos_start for s in ordered], dtype=i64, device=device)
    ctx_lens = torch.tensor(ctx_lens_list, dtype=i64, device=device)

    # Per-row view: sorted segments tile rows 0..T-1 in order.
    seg_of_row = torch.repeat_interleave(torch.arange(num_segs, device=device), seg_rows)
    rows = torch.arange(num_rows, dtype=i64, device=device)
    offset_in_seg = rows - row_start[seg_of_row]
    positions = pos_start[seg_of_row] + offset_in_seg
    slot_mapping = tables[seg_of_row, positions // block_size] * block_size + positions % block_size

    groups = bucket_segments(rows_list, ctx_lens_list) if bucketed else [list(range(num_segs))]
    if len(groups) == 1:
        # One bucket is the full grid: no index remapping, same cost as an unbucketed build.
        query_rows, context_slots = _query_and_context_grid(
            tables, row_start, seg_rows, ctx_lens, q_max, c_max, block_size
        )
        mask = _causal_mask(pos_start, seg_rows, q_max, c_max)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            positions=positions,
            context_lens=ctx_lens,
            buckets=(AttentionBucket(query_rows, context_slots, mask, num_rows),),
            row_to_bucketed=seg_of_row * q_max + offset_in_seg,
            block_size=block_size,
            num_rows=num_rows,
            max_block_id=max_block_id,
        )

    buckets: list[AttentionBucket] = []
    seg_base = [0] * num_segs  # flat index of each segment's first query in the bucket grids
    base = 0
    for group in groups:
        qb = max(rows_list[i] for i in group)
        cb = max(ctx_lens_list[i] for i in group)
        bb = max(blocks_needed[i] for i in group)
        for j, i in enumerate(group):
            seg_base[i] = base + j * qb
        base += len(group) * qb
        idx = torch.tensor(group, dtype=i64, device=device)
        b_rows, b_pos = seg_rows[idx], pos_start[idx]
        query_rows, context_slots = _query_and_context_grid(
            tables[idx, :bb], row_start[idx], b_rows, ctx_lens[idx], qb, cb, block_size
        )
        mask = _causal_mask(b_pos, b_rows, qb, cb)
        n_rows = sum(rows_list[i] for i in group)
        buckets.append(AttentionBucket(query_rows, context_slots, mask, n_rows))
    seg_base_t = torch.tensor(seg_base, dtype=i64, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        positions=positions,
        context_lens=ctx_lens,
        buckets=tuple(buckets),
        row_to_bucketed=seg_base_t[seg_of_row] + offset_in_seg,
        block_size=block_size,
        num_rows=num_rows,
        max_block_id=max_block_id,
        _grid_inputs=_GridInputs(
            tables, row_start, seg_rows, pos_start, seg_of_row, offset_in_seg, q_max, c_max
        ),
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


def _attend_bucket(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: AttentionBucket,
    block_size: int,
    scale: float,
    acc: torch.dtype,
) -> torch.Tensor:
    """One bucket's padded attention: [Sb * Qb, H, hd] in ``acc``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    num_segs, q_max, c_max = bucket.num_segments, bucket.q_max, bucket.c_max
    # Two-index gather works for any cache strides (no flatten copy of the whole pool).
    blk, off = bucket.context_slots // block_size, bucket.context_slots % block_size
    keys = k_cache[blk, off].to(acc)  # [Sb, Cb, kvh, hd]
    vals = v_cache[blk, off].to(acc)

    # GQA without repeating K/V: fold the query group into the query axis per kv head.
    qs = q[bucket.query_rows].to(acc)  # [Sb, Qb, H, hd]
    qs = qs.view(num_segs, q_max, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(num_segs, kv_heads, group * q_max, head_dim)
    scores = torch.matmul(qs, keys.permute(0, 2, 3, 1)) * scale  # [Sb, kvh, G*Qb, Cb]
    scores = scores.view(num_segs, kv_heads, group, q_max, c_max)
    scores = scores.masked_fill(~bucket.mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_segs, kv_heads, group * q_max, c_max)
    out = torch.matmul(probs, vals.permute(0, 2, 1, 3))  # [Sb, kvh, G*Qb, hd]
    out = out.view(num_segs, kv_heads, group, q_max, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_segs * q_max, num_heads, head_dim)


def check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """The checks every attention backend makes before it runs (no device sync)."""
    num_rows, num_heads, _ = q.shape
    if num_rows != meta.num_rows:
        raise ValueError(f"q has {num_rows} rows but metadata was built for {meta.num_rows}")
    check_cache_shape(k_cache, v_cache, meta)
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {kv_heads}")


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
    check_attention_inputs(q, k_cache, v_cache, meta)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    # Float32 at least for the softmax; float64 inputs stay float64.
    acc = torch.promote_types(q.dtype, torch.float32)
    outs = [
        _attend_bucket(q, k_cache, v_cache, b, meta.block_size, scale, acc) for b in meta.buckets
    ]
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat[meta.row_to_bucketed].to(q.dtype)
