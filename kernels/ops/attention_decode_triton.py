"""Triton paged attention's decode kernel (max_query_len = 1), split over the context
(flash-decoding), its combine step and their launcher (``_decode``); the layout, the
guarantees and the prompt kernels are ``attention_triton.py``'s, which calls it.

Also here: ``_zero_uncovered_rows``, which every kernel's program (0, head) runs so the
output needs no memset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops._triton import DECODE_BLOCK_N, next_power_of_2
from kernels.ops.kv_fp8_triton import fp8_rows


@triton.jit
def _zero_uncovered_rows(
    out_ptr,
    starts_ptr,
    num_segs,
    num_rows,
    head,
    out_s0,
    out_s1,
    out_s2,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Zeros head ``head`` of the rows no segment covers (before query_start[0] and from
    query_start[S] on), so the output needs no memset before the kernels run."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    zeros = tl.zeros([BLOCK_D], out_ptr.dtype.element_ty)
    first = tl.load(starts_ptr)
    last = tl.load(starts_ptr + num_segs)
    for r in range(0, first):
        tl.store(out_ptr + r * out_s0 + head * out_s1 + d * out_s2, zeros, mask=d_ok)
    for r in range(last, num_rows):
        tl.store(out_ptr + r * out_s0 + head * out_s1 + d * out_s2, zeros, mask=d_ok)


@triton.jit
def _attn_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    ctx_ptr,
    starts_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
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
    num_heads,
    num_segs,
    num_rows,
    split_align,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(starts_ptr + seg)
    n = tl.load(starts_ptr + seg + 1) - row0  # 0 or 1 (max_query_len is 1)
    ctx = tl.load(ctx_ptr + seg)
    kv_end = tl.where(n > 0, ctx - n + 1, 0)
    # This split's keys: an equal share of the context, rounded up to ``split_align``; the
    # last splits of a short context get none (an empty partial: m = -inf, l = 0).
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), split_align) * split_align
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    row = row0.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # the row's columns; none for a segment without a row (its row0 may be past the end)
    row_ok = d < tl.where(n > 0, HEAD_DIM, 0)
    q = tl.load(q_ptr + row * q_s0 + head * q_s1 + d * q_s2, mask=row_ok, other=0.0)
    q = q.to(tl.float32)
    kv_head = head // group
    table = tables_ptr + seg.to(tl.int64) * tables_s0

    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        c_ok = c < hi
        blk = tl.load(table + c // block_size, mask=c_ok, other=0).to(tl.int64)
        off = c % block_size
        kv_ok = c_ok[:, None] & d_ok[None, :]
        # K and V of the tile are loaded together, before the math that needs them
        k_rows = blk * k_s0 + off * k_s1 + kv_head * k_s2
        v_rows = blk * v_s0 + off * v_s1 + kv_head * v_s2
        if FP8:
            sc_rows = blk * sc_s0 + off * sc_s1 + kv_head * sc_s2
            k = fp8_rows(k_ptr + k_rows[:, None] + d[None, :] * k_s3, kv_ok, ks_ptr + sc_rows, c_ok)
            v = fp8_rows(v_ptr + v_rows[:, None] + d[None, :] * v_s3, kv_ok, vs_ptr + sc_rows, c_ok)
        else:
            k = tl.load(k_ptr + k_rows[:, None] + d[None, :] * k_s3, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + v_rows[:, None] + d[None, :] * v_s3, mask=kv_ok, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        s = tl.where(c_ok, s, float("-inf"))
        # position `start` is inside the split, so m_new is finite from the first tile on
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)
        dst = out_ptr + row * out_s0 + head * out_s1 + d * out_s2
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok)
        if seg == 0:
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
    else:
        part = (seg * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part.to(tl.int64) * BLOCK_D + d, acc)
        tl.store(part_ml_ptr + part * 2, m_i)
        tl.store(part_ml_ptr + part * 2 + 1, l_i)


@triton.jit
def _attn_decode_combine_kernel(
    starts_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    out_s0,
    out_s1,
    out_s2,
    num_heads,
    num_segs,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    row0 = tl.load(starts_ptr + seg)
    n = tl.load(starts_ptr + seg + 1) - row0
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < NUM_SPLITS
    part = (seg * num_heads + head) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + part * 2, mask=sp_ok, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + part * 2 + 1, mask=sp_ok, other=0.0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(
        part_acc_ptr + part.to(tl.int64)[:, None] * BLOCK_D + d[None, :],
        mask=sp_ok[:, None],
        other=0.0,
    )
    m_all = tl.max(m, axis=0)
    # empty splits (m = -inf) weigh 0; a row with no key at all comes out 0
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_safe)
    num = tl.sum(w[:, None] * acc, axis=0)
    den = tl.sum(w * l_part, axis=0)
    out = num / tl.where(den > 0, den, 1.0)
    row_ok = d < tl.where(n > 0, HEAD_DIM, 0)
    dst = out_ptr + row0.to(tl.int64) * out_s0 + head * out_s1 + d * out_s2
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok)
    if seg == 0:
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


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    fp8: bool,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    out: torch.Tensor,
    strides: tuple[int, ...],
    scale: float,
    splits: int,
    split_align: int,
) -> None:
    """The split decode kernel, then (with more than one split) the combine step."""
    if splits < 1 or split_align < 1:
        raise ValueError(f"num_splits {splits} and split_align {split_align} must be >= 1")
    num_rows, num_heads, head_dim = q.shape
    num_segs = block_tables.shape[0]
    block_d = next_power_of_2(head_dim)
    # float32 partials, [S, nh, splits, BLOCK_D] and (m, l) pairs; with one split the
    # kernel writes the output itself and never touches them (``out`` stands in)
    part_acc = part_ml = out
    if splits > 1:
        part_acc = q.new_empty((num_segs, num_heads, splits, block_d), dtype=torch.float32)
        part_ml = q.new_empty((num_segs, num_heads, splits, 2), dtype=torch.float32)
    tile = DECODE_BLOCK_N
    _attn_decode_split_kernel[(num_segs, num_heads, splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        query_start,
        out,
        part_acc,
        part_ml,
        *strides,
        scale,
        k_cache.shape[1],
        num_heads // k_cache.shape[2],
        num_heads,
        num_segs,
        num_rows,
        split_align,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=tile,
        NUM_SPLITS=splits,
        FP8=fp8,
        num_warps=8 if tile * block_d >= 8192 else 4,
    )
    if splits > 1:
        _attn_decode_combine_kernel[(num_segs, num_heads)](
            query_start,
            out,
            part_acc,
            part_ml,
            *out.stride(),
            num_heads,
            num_segs,
            num_rows,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            SPLITS_P2=next_power_of_2(splits),
            num_warps=4,
        )
