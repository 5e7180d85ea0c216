"""Triton paged attention: online softmax over each segment's context, block by block.

Imported only when a Triton path runs (see ``kernels.ops._triton``). Three kernels share the
layout of ``kernels.ops.attention``:

* decode (max_query_len = 1), split over the context (flash-decoding): grid S x nh x splits,
  each split walking its share of the keys, found from context_lens on the device, in key
  tiles with K and V loaded together; then one combine step per (segment, head). With one
  split the first kernel writes the output itself;
* per query (grid S x nh x max_query_len): scores by elementwise multiply and sum, no tl.dot,
  so any head dim works; short chunks without gathered rows use it;
* query tiles of 16-64 rows (grid S x nh x tiles): scores and P @ V through tl.dot.

With ``query_pos`` (a segment of gathered rows: a token-sparse loop's active tokens) the two
prompt kernels load each row's own position; a program's key loop runs to the largest of its
rows', so a tile of active tokens reads their shared context once. One-row segments take the
decode kernel either way (their row sits at context_lens - 1).

The context loop bound comes from context_lens inside the kernel, so the grid depends only on
(S, nh, max_query_len, splits): a decode step can be captured in a CUDA graph and replayed as
contexts grow. Loads past the context use ``other=0`` and scores there are -inf before the
softmax, so stale or NaN cache memory and unused block table entries never reach the output.
Every output element is stored by a kernel (rows no segment covers get zeros from program
(0, head)), so the output needs no memset. The decode kernel, its combine step and their
launcher are ``attention_decode_triton.py``.

With ``FP8`` the caches hold e4m3 codes and ``ks_ptr`` / ``vs_ptr`` one float32 scale per slot
and kv head: each tile is dequantised in registers as it is loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops._triton import decode_splits, next_power_of_2, num_sms
from kernels.ops.attention_decode_triton import DECODE_BLOCK_N, _decode, _zero_uncovered_rows
from kernels.ops.kv_fp8_triton import fp8_cols, fp8_rows

# Smallest query tile for tl.dot (its M, N and K must all be >= 16).
MIN_DOT_TILE = 16


@triton.jit
def _attn_query_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    ctx_ptr,
    starts_ptr,
    qpos_ptr,
    out_ptr,
    q_s0,
    q_s1,
    q_s2,
    k_s0,
    k_s1,
    k_s2,
    k_s3,
    v_s0,
    v_s1,
    v_s2,
    v_s3,
    sc_s0,
    sc_s1,
    sc_s2,
    tables_s0,
    out_s0,
    out_s1,
    out_s2,
    scale,
    block_size,
    group,
    num_segs,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    FP8: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.program_id(2)
    row0 = tl.load(starts_ptr + seg)
    n = tl.load(starts_ptr + seg + 1) - row0
    ctx = tl.load(ctx_ptr + seg)
    # This query sees positions 0 .. its own (query_pos, or ctx - n + j); none when the
    # segment has no row j.
    if HAS_QPOS:  # noqa: SIM108 - a constexpr branch: the kernel without it loads nothing
        pos = tl.load(qpos_ptr + row0 + j, mask=j < n, other=-1)
    else:
        pos = ctx - n + j
    kv_end = tl.where(j < n, pos + 1, 0)
    row = (row0 + j).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < tl.where(j < n, HEAD_DIM, 0)
    q = tl.load(q_ptr + row * q_s0 + head * q_s1 + d * q_s2, mask=d_ok, other=0.0)
    q = q.to(tl.float32)
    kv_head = head // group
    table = tables_ptr + seg.to(tl.int64) * tables_s0

    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        c_ok = c < kv_end
        blk = tl.load(table + c // block_size, mask=c_ok, other=0).to(tl.int64)
        off = c % block_size
        kv_ok = c_ok[:, None] & d_ok[None, :]
        k_rows = blk * k_s0 + off * k_s1 + kv_head * k_s2
        sc_rows = blk * sc_s0 + off * sc_s1 + kv_head * sc_s2
        if FP8:
            k = fp8_rows(k_ptr + k_rows[:, None] + d[None, :] * k_s3, kv_ok, ks_ptr + sc_rows, c_ok)
        else:
            k = tl.load(k_ptr + k_rows[:, None] + d[None, :] * k_s3, mask=kv_ok, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        s = tl.where(c_ok, s, float("-inf"))
        # Position `start` is always visible, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v_rows = blk * v_s0 + off * v_s1 + kv_head * v_s2
        if FP8:
            v = fp8_rows(v_ptr + v_rows[:, None] + d[None, :] * v_s3, kv_ok, vs_ptr + sc_rows, c_ok)
        else:
            v = tl.load(v_ptr + v_rows[:, None] + d[None, :] * v_s3, mask=kv_ok, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    dst = out_ptr + row * out_s0 + head * out_s1 + d * out_s2
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    if (seg == 0) & (j == 0):
        _zero_uncovered_rows(
            out_ptr,
            starts_ptr,
            num_segs,
            num_rows,
            head,
            out_s0,
            out_s1,
            out_s2,
            HEAD_DIM,
            BLOCK_D,
        )


@triton.jit
def _attn_tile_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    ctx_ptr,
    starts_ptr,
    qpos_ptr,
    out_ptr,
    q_s0,
    q_s1,
    q_s2,
    k_s0,
    k_s1,
    k_s2,
    k_s3,
    v_s0,
    v_s1,
    v_s2,
    v_s3,
    sc_s0,
    sc_s1,
    sc_s2,
    tables_s0,
    out_s0,
    out_s1,
    out_s2,
    scale,
    block_size,
    group,
    num_segs,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    FP8: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    row0 = tl.load(starts_ptr + seg)
    n = tl.load(starts_ptr + seg + 1) - row0
    ctx = tl.load(ctx_ptr + seg)
    j = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = j < n
    if HAS_QPOS:
        # each row's own position; the tile's keys run to the largest of its rows' (-1 for
        # padding rows: they see nothing), so one read of the context serves the tile
        pos = tl.load(qpos_ptr + row0 + j, mask=q_ok, other=-1)
        kv_end = tl.max(pos, axis=0) + 1
    else:
        pos = ctx - n + j
        # Keys up to the tile's last real query; none when the tile is past the segment's rows.
        kv_end = tl.where(tile * BLOCK_M < n, ctx - n + tl.minimum(n, (tile + 1) * BLOCK_M), 0)
    rows = (row0 + j).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_tile = q_ptr + rows[:, None] * q_s0 + head * q_s1 + d[None, :] * q_s2
    q = tl.load(q_tile, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    kv_head = head // group
    table = tables_ptr + seg.to(tl.int64) * tables_s0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        c_ok = c < kv_end
        blk = tl.load(table + c // block_size, mask=c_ok, other=0).to(tl.int64)
        off = c % block_size
        k_cols = blk * k_s0 + off * k_s1 + kv_head * k_s2
        sc_rows = blk * sc_s0 + off * sc_s1 + kv_head * sc_s2
        # K loaded transposed, [BLOCK_D, BLOCK_N], so the scores are a plain q @ kT.
        kt_ptrs = k_ptr + k_cols[None, :] + d[:, None] * k_s3
        kt_ok = d_ok[:, None] & c_ok[None, :]
        if FP8:  # dequantised in float32, then in q's dtype for tl.dot
            kt = fp8_cols(kt_ptrs, kt_ok, ks_ptr + sc_rows, c_ok).to(q.dtype)
        else:
            kt = tl.load(kt_ptrs, mask=kt_ok, other=0.0)
        s = tl.dot(q, kt, input_precision="ieee") * scale
        visible = (c[None, :] <= pos[:, None]) & c_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Padded query rows see nothing: keep their exponents finite (p = 0, alpha = 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = blk * v_s0 + off * v_s1 + kv_head * v_s2
        v_ptrs = v_ptr + v_rows[:, None] + d[None, :] * v_s3
        v_ok = c_ok[:, None] & d_ok[None, :]
        if FP8:
            v = fp8_rows(v_ptrs, v_ok, vs_ptr + sc_rows, c_ok).to(q.dtype)
        else:
            v = tl.load(v_ptrs, mask=v_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * out_s0 + head * out_s1 + d[None, :] * out_s2
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])
    if (seg == 0) & (tile == 0):
        _zero_uncovered_rows(
            out_ptr,
            starts_ptr,
            num_segs,
            num_rows,
            head,
            out_s0,
            out_s1,
            out_s2,
            HEAD_DIM,
            BLOCK_D,
        )


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
) -> None:
    num_segs = block_tables.shape[0]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if context_lens.shape != (num_segs,) or query_start.shape != (num_segs + 1,):
        raise ValueError(
            f"{num_segs} block tables, context_lens {tuple(context_lens.shape)}, "
            f"query_start {tuple(query_start.shape)}"
        )


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
    tiled: bool | None = None,
    num_splits: int | None = None,
    split_align: int = DECODE_BLOCK_N,
) -> torch.Tensor:
    _check(q, k_cache, v_cache, block_tables, context_lens, query_start)
    fp8 = k_scale is not None
    if fp8 and (v_scale is None or k_scale.shape != k_cache.shape[:3]):
        raise ValueError(
            f"fp8 caches {tuple(k_cache.shape)} need k_scale and v_scale [NB, bs, nkv]"
        )
    if fp8 and k_scale.stride() != v_scale.stride():
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    if query_pos is not None and query_pos.shape != (q.shape[0],):
        raise ValueError(f"query_pos {tuple(query_pos.shape)} for {q.shape[0]} query rows")
    num_rows, num_heads, head_dim = q.shape
    num_segs = block_tables.shape[0]
    # No memset: the kernels store every element, zeros where no segment covers a row.
    out = q.new_empty(q.shape)
    if num_rows == 0:
        return out
    if num_segs == 0 or max_query_len <= 0:
        return out.zero_()
    block_d = next_power_of_2(head_dim)
    if tiled is None:
        # gathered rows take the tiled kernel from 2 rows on: one program per query tile, so
        # one read of their context per tile, where the per-query kernel reads it per row
        gathered = query_pos is not None and max_query_len > 1 and block_d >= MIN_DOT_TILE
        tiled = max_query_len >= MIN_DOT_TILE or gathered
    if tiled and block_d < MIN_DOT_TILE:
        raise ValueError(f"the tl.dot kernel needs head_dim >= {MIN_DOT_TILE}, got {head_dim}")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    # without fp8 the scale pointers are never read: the caches stand in
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    strides = (
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *(ks.stride() if fp8 else (0, 0, 0)),
        block_tables.stride(0),
        *out.stride(),
    )
    # One-row segments take the decode kernel even with query_pos: a segment's context is its
    # largest row's visible length, so its one row sits at context_lens - 1 either way.
    if max_query_len == 1 and not tiled:
        splits = num_splits or decode_splits(num_segs, num_heads, num_sms(q.device))
        _decode(
            q,
            k_cache,
            v_cache,
            ks,
            vs,
            fp8,
            block_tables,
            context_lens,
            query_start,
            out,
            strides,
            scale,
            splits,
            split_align,
        )
        return out
    common = (
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        context_lens,
        query_start,
        query_start if query_pos is None else query_pos,  # never read without HAS_QPOS
        out,
        *strides,
        scale,
        k_cache.shape[1],
        num_heads // k_cache.shape[2],
        num_segs,
        num_rows,
    )
    has_qpos = query_pos is not None
    if tiled:
        block_m = min(64, max(MIN_DOT_TILE, next_power_of_2(max_query_len)))
        grid = (num_segs, num_heads, triton.cdiv(max_query_len, block_m))
        _attn_tile_kernel[grid](
            *common,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=64 if block_d <= 64 else 32,
            HAS_QPOS=has_qpos,
            FP8=fp8,
            num_warps=4,
            num_stages=2,
        )
    else:
        grid = (num_segs, num_heads, max_query_len)
        _attn_query_kernel[grid](
            *common,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=max(16, min(64, 4096 // block_d)),
            HAS_QPOS=has_qpos,
            FP8=fp8,
            num_warps=4 if block_d >= 64 else 2,
        )
    return out
