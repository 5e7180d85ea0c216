"""Triton ``rlt::paged_attention_int4``: one program per (query row, head) walks the row's
context block by block. A block before the query's own is read back from its codes inside
the kernel, the planes of its segment's chain summed (the host packs it from the anchor up;
each plane's delta ``code * scale + zero`` where the plane stores the token); the query's own
block comes exact from the tail. The softmax is
online, so no dequantised copy of the context exists anywhere. Layout and the tail rule are
``attention_int4.py``'s; the arithmetic of the read-back is ``kv_int4.py``'s.

``_attend_block`` (one block folded into a row's online softmax) and ``Int4Operands`` (the
cache's pointers and strides in the order the kernels take them) are shared with the split-K
decode kernel, ``attention_int4_decode_triton.py``.

Uses only triton.language APIs present in triton 3.6 and 3.9, and runs under
``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_codec import value_group
from kernels.ops._triton import next_power_of_2


@triton.jit
def _int4_rows(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    blk,
    offs,
    kv_head,
    d,
    d_ok,
    ok,
    st,
    c_s0,
    c_s1,
    c_s2,
    p_s0,
    p_s1,
    p_s2,
    p_s3,
    PER_CHANNEL: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One plane's delta of a block's rows [BS, D]: ``(code * scale + zero) * stored``."""
    byte_ptr = codes_ptr + blk * c_s0 + offs[:, None] * c_s1 + kv_head * c_s2 + (d // 2)[None, :]
    packed = tl.load(byte_ptr, mask=ok, other=0).to(tl.int32)
    code = (packed >> ((d % 2) * 4)[None, :]) & 15
    if PER_CHANNEL:  # keys: [blocks, kv_heads, head_dim]
        at = blk * p_s0 + kv_head * p_s1 + d * p_s2
        s = tl.load(scale_ptr + at, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.load(zero_ptr + at, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    else:  # values: [blocks, bs, kv_heads, head_dim // GROUP]
        at = blk * p_s0 + offs[:, None] * p_s1 + kv_head * p_s2 + (d // GROUP)[None, :] * p_s3
        s = tl.load(scale_ptr + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return (code.to(tl.float32) * s + z) * st[:, None]


@triton.jit
def _attend_block(
    b,
    seg,
    pos,
    plane,
    kv_head,
    q,
    m_i,
    l_i,
    acc,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    stored_ptr,
    kt_ptr,
    vt_ptr,
    tables_ptr,
    tails_ptr,
    c_s0,
    c_s1,
    c_s2,
    kp_s0,
    kp_s1,
    vp_s0,
    vp_s1,
    vp_s2,
    st_s0,
    t_s0,
    t_s1,
    t_s2,
    tab_s0,
    tab_s1,
    tails_s0,
    scale,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    VGROUP: tl.constexpr,
):
    """Block ``b`` of the segment's context folded into a query's online softmax
    (m_i, l_i, acc), its keys up to ``pos``: read back from the chain's codes before the
    query's own block, exact from the tail for it. Returns the new (m_i, l_i, acc)."""
    offs = tl.arange(0, BLOCK_BS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    key_pos = b * block_size + offs
    key_ok = (offs < block_size) & (key_pos <= pos)
    ok = key_ok[:, None] & d_ok[None, :]
    if b < pos // block_size:  # sealed: its chain's planes 0..plane of codes
        k = tl.zeros([BLOCK_BS, BLOCK_D], tl.float32)
        v = tl.zeros([BLOCK_BS, BLOCK_D], tl.float32)
        for j in range(0, plane + 1):
            blk = tl.load(tables_ptr + seg * tab_s0 + j * tab_s1 + b).to(tl.int64)
            st = tl.load(stored_ptr + blk * st_s0 + offs, mask=key_ok, other=0).to(tl.float32)
            k += _int4_rows(
                kc_ptr, ks_ptr, kz_ptr, blk, offs, kv_head, d, d_ok, ok, st,
                c_s0, c_s1, c_s2, kp_s0, kp_s1, 1, 1, True, VGROUP,
            )  # fmt: skip
            v += _int4_rows(
                vc_ptr, vs_ptr, vz_ptr, blk, offs, kv_head, d, d_ok, ok, st,
                c_s0, c_s1, c_s2, vp_s0, vp_s1, vp_s2, 1, False, VGROUP,
            )  # fmt: skip
    else:  # the query's own block: exact, from the tail
        tail = tl.load(tails_ptr + seg * tails_s0 + b).to(tl.int64)
        at = tail * t_s0 + offs[:, None] * t_s1 + kv_head * t_s2 + d[None, :]
        k = tl.load(kt_ptr + at, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(vt_ptr + at, mask=ok, other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], axis=1) * scale
    s = tl.where(key_ok, s, float("-inf"))
    # the block's first key is visible (b <= pos // block_size): m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    return m_new, l_i, acc


@triton.jit
def _attn_int4_kernel(
    q_ptr,
    out_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    stored_ptr,
    kt_ptr,
    vt_ptr,
    tables_ptr,
    tails_ptr,
    planes_ptr,
    row_seg_ptr,
    row_pos_ptr,
    q_s0,
    q_s1,
    out_s0,
    out_s1,
    c_s0,
    c_s1,
    c_s2,
    kp_s0,
    kp_s1,
    vp_s0,
    vp_s1,
    vp_s2,
    st_s0,
    t_s0,
    t_s1,
    t_s2,
    tab_s0,
    tab_s1,
    tails_s0,
    scale,
    block_size,
    group,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    VGROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seg = tl.load(row_seg_ptr + row).to(tl.int64)
    pos = tl.load(row_pos_ptr + row)
    kv_head = head // group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_ok = d < tl.where(seg >= 0, HEAD_DIM, 0)  # no segment: q reads 0 (out is 0)
    q = tl.load(q_ptr + row * q_s0 + head * q_s1 + d, mask=row_ok, other=0.0)
    q = q.to(tl.float32)
    plane = tl.load(planes_ptr + tl.maximum(seg, 0))
    m_i = tl.max(tl.full([BLOCK_BS], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_BS], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    last = tl.where(seg >= 0, pos // block_size + 1, 0)
    for b in range(0, last):
        m_i, l_i, acc = _attend_block(
            b, seg, pos, plane, kv_head, q, m_i, l_i, acc,
            kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, stored_ptr, kt_ptr, vt_ptr,
            tables_ptr, tails_ptr,
            c_s0, c_s1, c_s2, kp_s0, kp_s1, vp_s0, vp_s1, vp_s2, st_s0, t_s0, t_s1, t_s2,
            tab_s0, tab_s1, tails_s0,
            scale, block_size, HEAD_DIM, BLOCK_D, BLOCK_BS, VGROUP,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    tl.store(
        out_ptr + row * out_s0 + head * out_s1 + d, out.to(out_ptr.dtype.element_ty), mask=d_ok
    )


class Int4Operands:
    """One call's cache tensors (contiguous) as the kernels take them: ``pointers`` (codes,
    scales, zeros, stored, tails, tables, tail tables, planes), ``strides``, and the
    compile-time sizes ``meta``."""

    def __init__(
        self,
        q: torch.Tensor,
        fields: tuple[torch.Tensor, ...],
        tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        kc, vc, ks, kz, vs, vz, stored, kt, vt = (t.contiguous() for t in fields)
        block_tables, tail_tables, planes = (t.contiguous() for t in tables)
        self.pointers = (kc, vc, ks, kz, vs, vz, stored, kt, vt, block_tables, tail_tables, planes)
        self.strides = (
            *kc.stride()[:3],
            *ks.stride()[:2],
            *vs.stride()[:3],
            stored.stride(0),
            *kt.stride()[:3],
            *block_tables.stride()[:2],
            tail_tables.stride(0),
        )
        hd, bs = q.shape[2], kt.shape[1]
        self.block_size = bs
        self.group = q.shape[1] // kt.shape[2]
        self.meta = {
            "HEAD_DIM": hd,
            "BLOCK_D": next_power_of_2(hd),
            "BLOCK_BS": next_power_of_2(bs),
            "VGROUP": value_group(hd),
        }


def paged_attention_int4_triton(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    stored: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    block_tables: torch.Tensor,
    tail_tables: torch.Tensor,
    planes: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's contract (``attention_int4.paged_attention_int4_reference``); rows no
    segment covers come out 0."""
    t, nh = q.shape[:2]
    out = torch.empty_like(q)
    if t == 0:
        return out
    device = q.device
    starts = query_start.long()
    rows = torch.arange(t, device=device)
    # each row's segment (-1: none) and position, on the device (no host sync)
    seg = torch.searchsorted(starts, rows, right=True) - 1
    covered = (rows >= starts[0]) & (rows < starts[-1])
    seg = torch.where(covered, seg.clamp(0, starts.numel() - 2), -1)
    safe = seg.clamp_min(0)
    if query_pos is not None:
        pos = query_pos.long()
    else:
        pos = context_lens.long()[safe] - (starts[safe + 1] - rows)
    pos = torch.where(covered, pos, 0)
    ops = Int4Operands(
        q,
        (k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, stored, k_tail, v_tail),
        (block_tables, tail_tables, planes),
    )
    qc = q.contiguous()
    _attn_int4_kernel[(t, nh)](
        qc, out, *ops.pointers, seg.contiguous(), pos.contiguous(),
        qc.stride(0), qc.stride(1), out.stride(0), out.stride(1), *ops.strides,
        scale, ops.block_size, ops.group, **ops.meta,
    )  # fmt: skip
    return out
