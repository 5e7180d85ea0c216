"""``rlt::paged_attention``: causal attention of packed query rows over paged K/V.

Layout: segment s owns query rows ``query_start[s] .. query_start[s+1] - 1`` (n_s rows, maybe
none) at positions ``context_lens[s] - n_s + j``, or, given ``query_pos``, at ``query_pos[r]``
for row r (ascending or not, gaps allowed: the active tokens of a token-sparse loop, one
segment so the kernels read their context once per query tile; ``context_lens[s]`` is then
the largest ``query_pos + 1`` of its rows). Each query sees positions ``0 .. its own`` of its
segment, whose K/V sit at slot ``block_tables[s, pos // bs] * bs + pos % bs``. Query head h
reads kv head ``h // (nh // nkv)``. Rows past ``query_start[S]`` are padding and come out zero.
Block table entries past a segment's context and cache memory there (maybe NaN) are never used.

With ``k_scale`` / ``v_scale`` [num_blocks, bs, nkv] (float32) the caches hold the fp8 codec's
e4m3 codes (uint8, ``kernels/kv_codec.py``): every kernel dequantises K/V as it reads them, so
no dequantised copy of the context is ever made.

Every tensor shape depends only on (T, S, max_query_len, block table width), never on values, so
the CUDA path is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.ops._triton import triton_available
from kernels.ops.kv_fp8 import fp8_decode_reference

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor context_lens, Tensor query_start, float scale, int max_query_len, "
    "Tensor? query_pos=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor"
)


class _Grid:
    """One grid's geometry: every index a layer's attention needs that depends only on the
    pass's metadata, so the layers of a pass share it (see ``_grids``)."""

    def __init__(
        self,
        tables: torch.Tensor,
        ctx: torch.Tensor,
        seg_start: torch.Tensor,
        seg_rows: torch.Tensor,
        num_rows: int,
        block_size: int,
        q_max: int,
        c_max: int,
        q_pos: torch.Tensor | None = None,
    ) -> None:
        """``q_pos`` [T]: each packed row's own position (``query_pos``); without it a
        segment's queries are the last rows of its context."""
        dev = tables.device
        num_segs = tables.shape[0]
        self.q_max, self.c_max, self.num_segs = q_max, c_max, num_segs
        j = torch.arange(q_max, device=dev)
        q_ok = j < seg_rows[:, None]  # [S, Q]
        rows = seg_start[:, None] + j
        self.query_rows = rows.clamp(0, num_rows - 1).flatten()
        if q_pos is None:
            q_pos = ctx[:, None] - seg_rows[:, None] + j
        else:
            q_pos = q_pos.long().index_select(0, self.query_rows).view(num_segs, q_max)
        c = torch.arange(c_max, device=dev)
        self.c_ok = c < ctx[:, None]  # [S, C]
        # which positions each query sees, [S, 1, Q, C] (one mask for every head)
        visible = q_ok[:, :, None] & (c <= q_pos[:, :, None]) & self.c_ok[:, None, :]
        self.visible = visible[:, None]
        # Positions past a segment's context read its position 0 instead (written, so finite:
        # masked scores never multiply uninitialised, maybe NaN, memory); table entries there
        # may be garbage and are never used.
        tables = tables.long()
        self.blocks = torch.where(self.c_ok, tables[:, c // block_size], tables[:, :1])
        self.offsets = torch.where(self.c_ok, c % block_size, 0)
        self.slots = (self.blocks * block_size + self.offsets).flatten()
        self.out_rows = torch.where(q_ok, rows, num_rows).flatten()
        # every packed row once, in order (a decode-only pass): no scatter needed
        self.in_order = (
            dev.type == "cpu"
            and num_segs * q_max == num_rows
            and bool(torch.equal(self.out_rows, torch.arange(num_rows, device=dev)))
        )


def _attend_grid(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    grid: _Grid,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Segments padded to q_max queries over positions 0 .. c_max - 1 of their context.

    Returns the outputs [S * q_max, nh, hd] (float32 at least); row i belongs to packed row
    ``grid.out_rows[i]`` (T for a padding query).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_segs, q_max = grid.num_segs, grid.q_max
    # Float32 at least for scores and softmax; float64 inputs stay float64.
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = _gather(k_cache, k_scale, grid, acc)
    vals = _gather(v_cache, v_scale, grid, acc)

    qs = q.index_select(0, grid.query_rows).to(acc)
    qs = qs.view(num_segs, q_max, num_heads, head_dim).transpose(1, 2)  # [S, nh, Q, hd]
    # softmax(q k^T * scale, masked) v in one fused op: on CPU the flash kernel never
    # holds the [Q, C] scores, which dominated a prefill step's time. GQA without
    # repeating K/V: query head h reads kv head h // (nh // nkv). Padding queries see
    # nothing (their output may be NaN): the caller drops their rows.
    out = F.scaled_dot_product_attention(
        qs,
        keys.transpose(1, 2),
        vals.transpose(1, 2),
        attn_mask=grid.visible,
        scale=scale,
        enable_gqa=True,
    )  # [S, nh, Q, hd]
    return out.transpose(1, 2).reshape(num_segs * q_max, num_heads, head_dim)


def _gather(
    cache: torch.Tensor, scales: torch.Tensor | None, grid: _Grid, acc: torch.dtype
) -> torch.Tensor:
    """The grid's K or V [S, c_max, nkv, hd] in ``acc``, dequantised when ``scales`` is given
    (fp8 codes, one scale per slot and head)."""
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    if cache.is_contiguous():
        # one gather by flat slot (cheaper than indexing by block and offset)
        rows = cache.view(-1, kv_heads, head_dim).index_select(0, grid.slots)
        rows = rows.view(grid.num_segs, grid.c_max, kv_heads, head_dim)
    else:
        rows = cache[grid.blocks, grid.offsets]
    if scales is None:
        return rows.to(acc)
    if scales.is_contiguous():
        factor = scales.view(-1, kv_heads).index_select(0, grid.slots)
        factor = factor.view(grid.num_segs, grid.c_max, kv_heads)
    else:
        factor = scales[grid.blocks, grid.offsets]
    return (fp8_decode_reference(rows) * factor.unsqueeze(-1)).to(acc)


# The grids of the last pass seen, keyed by its metadata tensors themselves: every layer of a
# pass passes the same tensor objects, so the grids are built once per pass, not per layer.
# Holding the key tensors keeps their ids from being reused by a later pass.
_last: tuple[tuple[object, ...], list[_Grid]] | None = None


# Padded (query, context) pairs one grid may waste before the pass is split in two: each
# grid costs about a dozen small ops per layer, about as much as this many pairs.
_MERGE_SLACK = 4096


def _grids(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    num_rows: int,
    block_size: int,
    max_query_len: int,
    split_decode: bool,
    query_pos: torch.Tensor | None,
) -> list[_Grid]:
    global _last
    meta = (block_tables, context_lens, query_start) + (() if query_pos is None else (query_pos,))
    key = (
        *meta,
        tuple(_version(t) for t in meta),
        num_rows,
        block_size,
        max_query_len,
        split_decode,
    )
    if (
        _last is not None
        and len(_last[0]) == len(key)
        and all(
            a is b if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(_last[0], key, strict=True)
        )
    ):
        return _last[1]
    starts = query_start.long()
    seg_start, seg_rows = starts[:-1], starts[1:] - starts[:-1]
    ctx = context_lens.long()
    if not split_decode:
        c_max = block_tables.shape[1] * block_size
        parts = [(None, max_query_len, c_max)]
    else:
        parts = _split(seg_rows.tolist(), ctx.tolist())
    grids = [
        _Grid(
            block_tables if idx is None else block_tables[idx],
            ctx if idx is None else ctx[idx],
            seg_start if idx is None else seg_start[idx],
            seg_rows if idx is None else seg_rows[idx],
            num_rows,
            block_size,
            q_max,
            c_max,
            query_pos,
        )
        for idx, q_max, c_max in parts
        if q_max > 0 and c_max > 0
    ]
    _last = (key, grids)
    return grids


def _version(t: torch.Tensor) -> int:
    """In-place writes bump a tensor's version; inference tensors keep none (-1)."""
    return -1 if t.is_inference() else t._version


def _split(rows: list[int], ctx: list[int]) -> list[tuple[torch.Tensor | None, int, int]]:
    """Decode segments (<= 1 row) and longer ones as two grids, each cut to its own longest
    context, unless one grid over all of them pads fewer than ``_MERGE_SLACK`` pairs more."""
    short = [i for i, n in enumerate(rows) if n <= 1]
    long = [i for i, n in enumerate(rows) if n > 1]
    whole = (None, max(rows, default=0), max(ctx, default=0))
    if not short or not long:
        return [whole]
    parts = [
        (torch.tensor(idx), max(rows[i] for i in idx), max(ctx[i] for i in idx))
        for idx in (short, long)
    ]
    split_pairs = sum(len(idx) * q * c for idx, (_, q, c) in zip((short, long), parts, strict=True))
    if len(rows) * whole[1] * whole[2] - split_pairs <= _MERGE_SLACK:
        return [whole]
    return parts


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_decode: bool | None = None,
) -> torch.Tensor:
    """Batched torch version: queries padded per segment, positions padded per segment.

    Without ``split_decode`` it reads no metadata on the host: one grid of every segment padded
    to max_query_len and the table width. With it (the default on CPU, where reading the
    metadata is free) decode segments (<= 1 row) and longer ones are two grids, each cut to its
    own longest context, so a chunk in the pass does not pad every decode row to its length.
    """
    num_rows, num_heads, head_dim = q.shape
    num_segs, max_blocks = block_tables.shape
    if num_rows == 0 or num_segs == 0 or max_query_len <= 0 or max_blocks == 0:
        return q.new_zeros(q.shape)
    if split_decode is None:
        split_decode = q.device.type == "cpu"
    grids = _grids(
        block_tables,
        context_lens,
        query_start,
        num_rows,
        k_cache.shape[1],
        max_query_len,
        split_decode,
        query_pos,
    )
    if len(grids) == 1 and grids[0].in_order:
        out = _attend_grid(q, k_cache, v_cache, grids[0], scale, k_scale, v_scale)
        return out.to(q.dtype).contiguous()
    # One spare row takes the padding queries' outputs, dropped at the end.
    out = q.new_zeros((num_rows + 1, num_heads, head_dim))
    for grid in grids:
        part = _attend_grid(q, k_cache, v_cache, grid, scale, k_scale, v_scale)
        out[grid.out_rows] = part.to(q.dtype)
    return out[:num_rows]


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiled: bool | None = None,
    num_splits: int | None = None,
    split_align: int | None = None,
) -> torch.Tensor:
    """The Triton kernels on any device Triton drives (CPU tensors under TRITON_INTERPRET=1).

    ``tiled`` picks the tl.dot kernel (query tiles of >= 16) over the per-query one; by default
    it is used from ``max_query_len >= 16`` on, and from 2 on with ``query_pos``. Decode
    (``max_query_len == 1``, not tiled) splits each context ``num_splits`` ways (default:
    from the grid's size and the device's SMs), each split's key range a multiple of
    ``split_align`` positions (default: the key tile).
    """
    from kernels.ops import attention_triton

    return attention_triton.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start,
        scale,
        max_query_len,
        query_pos,
        k_scale,
        v_scale,
        tiled=tiled,
        num_splits=num_splits,
        **({} if split_align is None else {"split_align": split_align}),
    )


# The dtype whose CUDA decode passes (max_query_len 1) go through flash-attn 4: set at start
# by kernels.ops.backends where it is exact and faster here for that dtype; None (and any
# other dtype): the Triton kernels.
_cuda_decode: dict[str, torch.dtype | None] = {"flash": None}


def use_flash_decode(dtype: torch.dtype | None) -> None:
    _cuda_decode["flash"] = dtype


def _paged_attention_cuda(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start, scale, max_query_len)
    plain = k_scale is None and v_scale is None
    if max_query_len == 1 and query_pos is None and plain and q.dtype == _cuda_decode["flash"]:
        from kernels.ops import attention_flash

        return attention_flash.paged_decode(*args)
    if triton_available():
        return paged_attention_triton(*args, query_pos, k_scale, v_scale)
    return paged_attention_reference(*args, query_pos, k_scale, v_scale)


def _paged_attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


_lib.impl("paged_attention", paged_attention_reference, "CPU")
_lib.impl("paged_attention", _paged_attention_cuda, "CUDA")
torch.library.register_fake("rlt::paged_attention", _paged_attention_fake, lib=_lib)

_paged_attention_op = torch.ops.rlt.paged_attention.default


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, nh, hd] over one layer's caches [num_blocks, bs, nkv, hd] -> [T, nh, hd] in
    q's dtype. block_tables [S, maxB], context_lens [S] and query_start [S + 1] are int32;
    max_query_len bounds every segment's row count (one ``rlt::paged_attention`` call).
    query_pos [T] int32, optional: each row's own position (see the module docstring).
    k_scale / v_scale [num_blocks, bs, nkv] float32, optional: the caches hold fp8 codes."""
    return _paged_attention_op(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start,
        scale,
        max_query_len,
        query_pos,
        k_scale,
        v_scale,
    )
