"""Attention of the rows a token-sparse loop runs: the active tokens of one request at
scattered positions, as ONE segment with ``query_pos`` (its context read once), give every
query exactly its causal attention, as the same rows would as one-token segments each,
beside dense chunks and decode rows of other requests."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.ops import attention
from messages.batch import BatchRow, RowKind, WorkerSampling
from services.worker.passes.rows import LiveRow

pytestmark = pytest.mark.unit


def _case(seed: int, block_size: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, hd = 2, 2, 16
    num_blocks = 128
    k_cache = torch.randn(num_blocks, block_size, kv_heads, hd, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, hd, generator=gen, dtype=torch.float64)
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    length = 40
    need = -(-length // block_size)
    sparse_table, blocks = blocks[:need], blocks[need:]
    other_table, blocks = blocks[:need], blocks[need:]
    # segments: (table, context length, rows); queries are the last rows of their context
    positions = sorted(rng.sample(range(length), 9))
    segments = [(other_table, 13, 1)]  # a decode row of another request
    segments += [(sparse_table, p + 1, 1) for p in positions[:5]]
    segments += [(other_table, 30, 6)]  # a chunk of another request
    segments += [(sparse_table, p + 1, 1) for p in positions[5:]]
    width = need + 1
    tables = torch.zeros(len(segments), width, dtype=torch.int32)
    for s, (table, ctx, _) in enumerate(segments):
        used = -(-ctx // block_size)
        tables[s, :used] = torch.tensor(table[:used])  # entries past a context stay 0
    rows = sum(n for _, _, n in segments)
    q = torch.randn(rows, kv_heads * group, hd, generator=gen, dtype=torch.float64)
    ctx = torch.tensor([c for _, c, _ in segments], dtype=torch.int32)
    starts = [0]
    for _, _, n in segments:
        starts.append(starts[-1] + n)
    args = (q, k_cache, v_cache, tables, ctx, torch.tensor(starts, dtype=torch.int32), hd**-0.5, 6)
    return args, segments, block_size


def _expected(args, segments, block_size: int) -> torch.Tensor:
    q, k_cache, v_cache, _, _, _, scale, _ = args
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    row = 0
    for table, ctx, n in segments:
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots]
        vals = v_cache.view(-1, *v_cache.shape[2:])[slots]
        for i in range(n):
            visible = ctx - n + i + 1
            for h in range(q.shape[1]):
                weights = torch.softmax(keys[:visible, h // group] @ q[row + i, h] * scale, 0)
                out[row + i, h] = weights @ vals[:visible, h // group]
        row += n
    return out


def _grouped(args, segments, block_size: int):
    """The same rows with each run of one-token rows of the sparse table as one segment:
    query_pos holds every row's position, context_lens its run's largest."""
    q, k_cache, v_cache, _, _, _, scale, _ = args
    merged: list[tuple[list[int], list[int]]] = []  # (table, positions) per segment
    previous = None
    for table, ctx, n in segments:
        positions = list(range(ctx - n, ctx))
        if n == 1 and previous is table and merged[-1][1][-1] < ctx - 1:
            merged[-1][1].append(ctx - 1)
        else:
            merged.append((table, positions))
        previous = table if n == 1 else None
    width = args[3].shape[1]
    tables = torch.zeros(len(merged), width, dtype=torch.int32)
    for s, (table, positions) in enumerate(merged):
        used = -(-(positions[-1] + 1) // block_size)
        tables[s, :used] = torch.tensor(table[:used])
    ctx = torch.tensor([p[-1] + 1 for _, p in merged], dtype=torch.int32)
    starts = [0]
    for _, p in merged:
        starts.append(starts[-1] + len(p))
    query_pos = torch.tensor([x for _, p in merged for x in p], dtype=torch.int32)
    longest = max(len(p) for _, p in merged)
    grouped = (q, k_cache, v_cache, tables, ctx, torch.tensor(starts, dtype=torch.int32))
    return (*grouped, scale, longest, query_pos), len(merged)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_active_rows_as_one_segment_are_exact(seed: int, block_size: int) -> None:
    args, segments, bs = _case(seed, block_size)
    grouped, num_segments = _grouped(args, segments, bs)
    assert num_segments == 4  # decode row, 5 active rows, chunk, 4 active rows
    want = _expected(args, segments, bs)
    for split in (True, False):
        out = attention.paged_attention_reference(*grouped, split_decode=split)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        # the one-token layout gives the same
        out = attention.paged_attention_reference(*args, split_decode=split)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def _planned(rows: list[LiveRow]):
    from services.worker.passes.pass_plan import PassPlanner, RequestView

    sampling = WorkerSampling(
        temperature=0.0, top_p=1.0, top_k=0, seed=0, min_loops=4, max_loops=4, exit_threshold=1.0
    )
    tables = [[5, 9, 2, 7, 11, 3], [1, 4, 6, 8, 10, 12]]
    requests = {
        name: RequestView(list(range(24)), sampling, [t, t], pool_slot=0)
        for name, t in zip("ab", tables, strict=True)
    }
    planner = PassPlanner(4, 4, False, 0, 0, host_words=lambda n: np.zeros(n, dtype=np.int32))
    return planner.plan(rows, requests, first_pass=False), tables


def _row(request: str, kind: RowKind, start: int, count: int, joins: bool = False) -> LiveRow:
    row = BatchRow(request_id=request, kind=kind, token_start=start, token_count=count, depth=2)
    return LiveRow(0, row, 2, 1, joins_segment=joins)


def test_a_fragments_rows_are_one_segment_at_their_own_positions() -> None:
    """The planner makes a fragment's active rows one attention segment (its context the
    last row's, the rows' positions in token.position, which the pass passes as query_pos),
    beside another request's decode row and chunk."""
    active = [3, 7, 8, 20]
    rows = [_row("b", RowKind.DECODE, 10, 1)]
    rows += [_row("a", RowKind.PREFILL, p, 1, joins=i > 0) for i, p in enumerate(active)]
    rows += [_row("b", RowKind.PREFILL, 11, 5)]
    plan, tables = _planned(rows)
    h = plan.host
    assert plan.gathered and plan.shape.num_segments == 3 and plan.max_query_len == 5
    assert h["segment.query_start"].tolist() == [0, 1, 5, 10]
    assert h["segment.context_len"].tolist() == [11, 21, 16]
    assert h["segment.table"][1].tolist() == tables[0]
    assert h["token.position"].tolist() == [10, *active, 11, 12, 13, 14, 15]
    # without a joining row, every row is its own segment and query_pos is not needed
    plan, _ = _planned([_row("a", RowKind.PREFILL, p, 1) for p in active])
    assert not plan.gathered and plan.shape.num_segments == 4 and plan.max_query_len == 1


@pytest.mark.parametrize(
    "previous",
    [
        _row("b", RowKind.PREFILL, 3, 1),  # another request
        _row("a", RowKind.PREFILL, 9, 1),  # a later position
        _row("a", RowKind.DECODE, 3, 1),  # a decode row
    ],
)
def test_a_row_joins_only_an_earlier_row_of_its_request(previous: LiveRow) -> None:
    with pytest.raises(ValueError, match="cannot join"):
        _planned([previous, _row("a", RowKind.PREFILL, 8, 1, joins=True)])
