"""Triton ``rlt::paged_attention_int4`` for decode passes (every segment at most one query
row), split over the context (split-K): grid (segments, heads, partitions), each partition a
run of whole blocks of its row's context folded into a partial online softmax (max, sum,
acc) by ``attention_int4_triton._attend_block``, so its sealed blocks are read back from
their chains' codes and the partition holding the row's own block reads it from the tail.
The fp8/auto decode path's combine step (``attention_decode_triton``) then merges the
partials and zeroes the rows no segment covers.

A short decode batch at long context (1 row x 8k, 16 heads) gives the plain kernel 16
programs; partitions give the GPU enough of them (``_triton.int4_decode_partitions``). The
partition bounds come from context_lens inside the kernel, so the grid depends only on
shapes: a short context leaves its last partitions empty (max -inf, sum 0, weight 0).

Uses only triton.language APIs present in triton 3.6 and 3.9, and runs under
``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops._triton import next_power_of_2, partition_blocks
from kernels.ops.attention_decode_triton import _attn_decode_combine_kernel
from kernels.ops.attention_int4_triton import Int4Operands, _attend_block


@triton.jit
def _attn_int4_split_kernel(
    q_ptr,
    part_acc_ptr,
    part_ml_ptr,
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
    ctx_ptr,
    starts_ptr,
    qpos_ptr,
    q_s0,
    q_s1,
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
    num_heads,
    split_align,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    VGROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_QPOS: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(starts_ptr + seg).to(tl.int64)
    n = tl.load(starts_ptr + seg + 1) - row  # 0 or 1 (max_query_len is 1)
    if HAS_QPOS:  # noqa: SIM108 - a constexpr branch: the kernel without it loads nothing
        pos = tl.load(qpos_ptr + row, mask=n > 0, other=0)
    else:
        pos = tl.load(ctx_ptr + seg) - 1
    # This partition's blocks: an equal share of the row's blocks up to its own, rounded up
    # to ``split_align`` blocks; a segment without a row has none.
    num_blocks = tl.where(n > 0, pos // block_size + 1, 0)
    chunk = tl.cdiv(tl.cdiv(num_blocks, NUM_SPLITS), split_align) * split_align
    lo = split * chunk
    hi = tl.minimum(lo + chunk, num_blocks)
    kv_head = head // group
    d = tl.arange(0, BLOCK_D)
    row_ok = d < tl.where(n > 0, HEAD_DIM, 0)  # a segment without a row may sit past the end
    q = tl.load(q_ptr + row * q_s0 + head * q_s1 + d, mask=row_ok, other=0.0)
    q = q.to(tl.float32)
    plane = tl.load(planes_ptr + seg)
    m_i = tl.max(tl.full([BLOCK_BS], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_BS], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for b in range(lo, hi):
        m_i, l_i, acc = _attend_block(
            b, seg, pos, plane, kv_head, q, m_i, l_i, acc,
            kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, stored_ptr, kt_ptr, vt_ptr,
            tables_ptr, tails_ptr,
            c_s0, c_s1, c_s2, kp_s0, kp_s1, vp_s0, vp_s1, vp_s2, st_s0, t_s0, t_s1, t_s2,
            tab_s0, tab_s1, tails_s0,
            scale, block_size, HEAD_DIM, BLOCK_D, BLOCK_BS, VGROUP,
        )  # fmt: skip
    # the combine step's layout: acc [S, nh, splits, BLOCK_D], (max, sum) [S, nh, splits, 2]
    part = (seg * num_heads + head) * NUM_SPLITS + split
    tl.store(part_acc_ptr + part * BLOCK_D + d, acc)
    tl.store(part_ml_ptr + part * 2, m_i)
    tl.store(part_ml_ptr + part * 2 + 1, l_i)


def paged_attention_int4_decode_triton(
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
    num_splits: int = 2,
    split_align: int | None = None,
) -> torch.Tensor:
    """The reference's contract (``attention_int4.paged_attention_int4_reference``) for
    ``max_query_len`` 1, each row's context cut into ``num_splits`` partitions of a multiple
    of ``split_align`` blocks (default ``partition_blocks``); rows no segment covers come
    out 0."""
    if max_query_len != 1:
        raise ValueError(f"split-K takes decode rows only, max_query_len {max_query_len}")
    num_rows, num_heads, head_dim = q.shape
    num_segs = block_tables.shape[0]
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    if num_segs == 0:
        return out.zero_()
    align = partition_blocks(k_tail.shape[1]) if split_align is None else split_align
    if num_splits < 1 or align < 1:
        raise ValueError(f"num_splits {num_splits} and split_align {align} must be >= 1")
    ops = Int4Operands(
        q,
        (k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, stored, k_tail, v_tail),
        (block_tables, tail_tables, planes),
    )
    block_d = ops.meta["BLOCK_D"]
    part_acc = q.new_empty((num_segs, num_heads, num_splits, block_d), dtype=torch.float32)
    part_ml = q.new_empty((num_segs, num_heads, num_splits, 2), dtype=torch.float32)
    qc, starts = q.contiguous(), query_start.contiguous()
    _attn_int4_split_kernel[(num_segs, num_heads, num_splits)](
        qc, part_acc, part_ml, *ops.pointers, context_lens.contiguous(), starts,
        starts if query_pos is None else query_pos.contiguous(),  # never read without HAS_QPOS
        qc.stride(0), qc.stride(1), *ops.strides,
        scale, ops.block_size, ops.group, num_heads, align,
        **ops.meta, NUM_SPLITS=num_splits, HAS_QPOS=query_pos is not None,
    )  # fmt: skip
    _attn_decode_combine_kernel[(num_segs, num_heads)](
        starts, out, part_acc, part_ml, *out.stride(), num_heads, num_segs, num_rows,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        SPLITS_P2=next_power_of_2(num_splits),
    )  # fmt: skip
    return out
