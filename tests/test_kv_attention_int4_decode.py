"""int4-delta's split-K decode kernel (kernels/ops/attention_int4_decode_triton.py) against the
torch reference of ``rlt::paged_attention_int4`` under TRITON_INTERPRET=1: contexts over
several partitions, a last partition partly filled, empty partitions, the own block from the
tail, tokens no plane above the anchor stores, chains of 1 to 4 planes, rows of different
contexts, GQA. Cache memory no read may touch is NaN. Also which kernel the CUDA dispatch
picks (``_triton.int4_decode_partitions``, and the dispatch itself on CPU tensors)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from kernels.ops._triton import (
    MAX_SPLITS,
    decode_splits,
    int4_decode_partitions,
    partition_blocks,
)
from tests.helpers import assert_passes_under_triton_interpreter

PLANES, BS = 4, 8


class _Case:
    """Decode segments (context, chain length less one, has a row) over random codes; a
    padding row before the first segment. Every block id, tail and table entry the reads
    must not touch holds NaN."""

    def __init__(
        self,
        seed: int,
        segs: list[tuple[int, int, bool]],
        nkv: int = 2,
        group: int = 1,
        hd: int = 16,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = max(-(-ctx // BS) for ctx, _, _ in segs) + 1  # a spare column past every ctx
        num_blocks = len(segs) * PLANES * width + 1
        vg = min(64, hd)
        nan = float("nan")

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=gen)

        self.k_codes = torch.randint(0, 256, (num_blocks, BS, nkv, hd // 2), generator=gen)
        self.v_codes = torch.randint(0, 256, (num_blocks, BS, nkv, hd // 2), generator=gen)
        self.k_codes, self.v_codes = self.k_codes.to(torch.uint8), self.v_codes.to(torch.uint8)
        self.k_scale = (0.05 + 0.2 * rand(num_blocks, nkv, hd)).half()
        self.k_zero = (rand(num_blocks, nkv, hd) - 0.5).half()
        self.v_scale = (0.05 + 0.2 * rand(num_blocks, BS, nkv, hd // vg)).half()
        self.v_zero = (rand(num_blocks, BS, nkv, hd // vg) - 0.5).half()
        self.stored = (rand(num_blocks, BS) < 0.6).to(torch.uint8)
        poison = num_blocks - 1  # never read: NaN scales
        for field in (self.k_scale, self.k_zero, self.v_scale, self.v_zero):
            field[poison] = nan
        ids = torch.randperm(num_blocks - 1, generator=gen)
        self.tables = torch.full((len(segs), PLANES, width), poison, dtype=torch.int32)
        self.tails = torch.full((len(segs), width), len(segs) * width, dtype=torch.int32)
        self.k_tail = torch.full((len(segs) * width + 1, BS, nkv, hd), nan)
        self.v_tail = torch.full_like(self.k_tail, nan)
        tail_ids = torch.randperm(len(segs) * width, generator=gen)
        rows = []
        for s, (ctx, plane, has_row) in enumerate(segs):
            own = (ctx - 1) // BS
            for j in range(plane + 1):  # the chain's sealed blocks
                self.tables[s, j, :own] = ids[(s * PLANES + j) * width :][:own].int()
            self.stored[self.tables[s, 0, :own].long()] = 1  # an anchor stores every token
            self.tails[s, own] = int(tail_ids[s * width + own])
            filled = ctx - own * BS  # the tail's rows past the context stay NaN
            self.k_tail[self.tails[s, own], :filled] = torch.randn(filled, nkv, hd, generator=gen)
            self.v_tail[self.tails[s, own], :filled] = torch.randn(filled, nkv, hd, generator=gen)
            rows.append(1 if has_row else 0)
        self.planes = torch.tensor([p for _, p, _ in segs], dtype=torch.int32)
        self.ctxs = torch.tensor([c for c, _, _ in segs], dtype=torch.int32)
        self.starts = torch.tensor([1, *(1 + torch.tensor(rows).cumsum(0)).tolist()]).int()
        self.q = torch.randn(1 + sum(rows), nkv * group, hd, generator=gen) * 2
        pos = [c - 1 for (c, _, has_row) in segs if has_row]
        self.query_pos = torch.tensor([0, *pos], dtype=torch.int32)

    def args(self, max_query_len: int = 1, gathered: bool = False) -> tuple[object, ...]:
        return (
            self.q, self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale,
            self.v_zero, self.stored, self.k_tail, self.v_tail, self.tables, self.tails,
            self.planes, self.ctxs, self.starts, self.q.shape[2] ** -0.5, max_query_len,
            self.query_pos if gathered else None,
        )  # fmt: skip


# (segments (context, plane, has a row), splits, split_align in blocks, gathered)
SPLIT_CASES = [
    # 8 / 4 / 2 blocks over 4 partitions of 1: full, full, two empty; planes 3, 0, 1
    ([(61, 3, True), (30, 0, True), (9, 1, True)], 4, 1, False),
    # 8 blocks over 3: 3 + 3 + 2, the last partly filled; own blocks at a block's first
    # and last key; a segment without a row
    ([(57, 2, True), (32, 1, True), (20, 0, False), (17, 3, True)], 3, 1, False),
    # partitions of 2 blocks: 8 blocks -> 4 + 4 + nothing; a one-key context
    ([(64, 3, True), (1, 0, True), (44, 2, True)], 3, 2, True),
]


def _split_checks() -> list[str]:
    from kernels.ops.attention_int4 import paged_attention_int4_reference
    from kernels.ops.attention_int4_decode_triton import paged_attention_int4_decode_triton

    found = []
    cases = [(_Case(10 + i, segs), *rest) for i, (segs, *rest) in enumerate(SPLIT_CASES)]
    # GQA: two query heads per kv head; then head dim 128, two value groups per token
    cases.append((_Case(20, [(50, 3, True), (23, 1, True)], group=2), 5, 1, False))
    cases.append((_Case(21, [(41, 2, True)], nkv=1, group=2, hd=128), 3, 1, False))
    for i, (case, splits, align, gathered) in enumerate(cases):
        args = case.args(gathered=gathered)
        want = paged_attention_int4_reference(*args)
        got = paged_attention_int4_decode_triton(*args, num_splits=splits, split_align=align)
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            found.append(f"split case {i}: max diff {(got - want).abs().max().item()}")
        if got[0].abs().max().item() != 0.0:
            found.append(f"split case {i}: the uncovered row is not 0")
    return found


def _dispatch_checks() -> list[str]:
    """The CUDA op's body on CPU tensors (the interpreter runs its kernels; 132 SMs assumed):
    which launcher it calls, and that its output is the reference's."""
    from kernels.ops import attention_int4, attention_int4_decode_triton, attention_int4_triton

    called: list[str] = []

    def spy(module: object, name: str) -> None:
        real = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> torch.Tensor:
            called.append(name)
            return real(*args, **kwargs)

        setattr(module, name, wrapper)

    spy(attention_int4_decode_triton, "paged_attention_int4_decode_triton")
    spy(attention_int4_triton, "paged_attention_int4_triton")
    # partitions of 8 blocks (64 keys at bs 8): a table of 10 fills two, one of 8 only one
    long_ctx = _Case(30, [(70, 2, True)], nkv=1)
    short_ctx = _Case(31, [(56, 2, True)], nkv=1)
    runs = [
        (long_ctx.args(), "paged_attention_int4_decode_triton"),
        (long_ctx.args(max_query_len=2), "paged_attention_int4_triton"),
        (short_ctx.args(), "paged_attention_int4_triton"),
    ]
    found = []
    for i, (args, want_kernel) in enumerate(runs):
        called.clear()
        got = attention_int4._paged_attention_int4_cuda(*args)
        want = attention_int4.paged_attention_int4_reference(*args)
        if called != [want_kernel]:
            found.append(f"dispatch run {i}: called {called}, wanted {want_kernel}")
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            found.append(f"dispatch run {i}: max diff {(got - want).abs().max().item()}")
    return found


@pytest.mark.unit
def test_partitions_are_for_decode_rows_at_long_context() -> None:
    assert partition_blocks(16) == 4 and partition_blocks(8) == 8 and partition_blocks(128) == 1
    # 1 row x 8k at bs 16, 16 heads: 16 programs alone; split as far as the fp8 kernel does
    assert int4_decode_partitions(1, 1, 16, 512, 16, 132) == MAX_SPLITS
    assert int4_decode_partitions(2, 1, 16, 512, 16, 132) == 1  # a prompt chunk
    assert int4_decode_partitions(1, 64, 16, 512, 16, 132) == 1  # the grid fills the GPU
    assert int4_decode_partitions(1, 1, 16, 4, 16, 132) == 1  # at most 64 keys: one partition
    assert int4_decode_partitions(1, 1, 16, 8, 16, 132) == 2  # 128 keys: two
    for segs in (1, 3, 8, 32, 128):
        want = decode_splits(segs, 16, 132)
        assert int4_decode_partitions(1, segs, 16, 4096, 16, 132) == want


@pytest.mark.unit
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_split_k_int4_decode_equals_the_reference() -> None:
    """Under TRITON_INTERPRET=1 in a fresh process (the interpreter is chosen when triton
    decorates a kernel)."""
    assert_passes_under_triton_interpreter("tests.test_kv_attention_int4_decode")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the checks run the Triton kernels on CPU tensors")
        sys.exit(2)
    mismatches = _split_checks() + _dispatch_checks()
    for line in mismatches:
        print("MISMATCH", line)
    sys.exit(1 if mismatches else 0)
