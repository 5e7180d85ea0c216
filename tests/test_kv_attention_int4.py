"""``rlt::paged_attention_int4`` (kernels/ops/attention_int4.py) against the oracle's
int4-delta read-back (services/oracle/kv_codec.py) and dense float64 attention: sealed blocks
written with ``rlt::int4_encode`` plane by plane (exited tokens storing nothing above their
top plane), open blocks exact in the tail cache, segments at different planes, chunks that
span blocks and gathered rows."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

from kernels.ops import kv_int4
from kernels.ops.attention_int4 import Int4Cache, paged_attention_int4
from services.oracle import kv_codec as oracle_codec
from tests.helpers import assert_passes_under_triton_interpreter

PLANES, BS, NKV, GROUP, HD = 4, 8, 2, 2, 16


class _Segment:
    def __init__(self, gen: torch.Generator, ctx: int, rows: int, plane: int) -> None:
        self.ctx, self.rows, self.plane = ctx, rows, plane
        k0 = torch.randn(ctx, NKV, HD, generator=gen) * 2
        v0 = torch.randn(ctx, NKV, HD, generator=gen)
        self.top = torch.randint(0, PLANES, (ctx,), generator=gen)
        self.k, self.v = [k0], [v0]
        for j in range(1, PLANES):
            still = (self.top < j)[:, None, None]
            nk = self.k[-1] + 0.3 * torch.randn(ctx, NKV, HD, generator=gen)
            nv = self.v[-1] + 0.3 * torch.randn(ctx, NKV, HD, generator=gen)
            self.k.append(torch.where(still, self.k[-1], nk))  # a copy: the last-exited rule
            self.v.append(torch.where(still, self.v[-1], nv))


def _build(seed: int, layout: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    """layout: (rows, context, plane) per segment."""
    gen = torch.Generator().manual_seed(seed)
    segs = [_Segment(gen, ctx, rows, plane) for rows, ctx, plane in layout]
    width = max(-(-s.ctx // BS) for s in segs)
    num_blocks = len(segs) * PLANES * width + 1
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: len(segs) * PLANES * width].view(len(segs), PLANES, width).int()
    tail_tables = torch.randperm(len(segs) * width, generator=gen).view(len(segs), width).int()
    half = HD // 2
    fields = [
        torch.zeros(num_blocks, BS, NKV, half, dtype=torch.uint8),
        torch.zeros(num_blocks, BS, NKV, half, dtype=torch.uint8),
        torch.full((num_blocks, NKV, HD), float("nan"), dtype=torch.float16),
        torch.full((num_blocks, NKV, HD), float("nan"), dtype=torch.float16),
        torch.full((num_blocks, BS, NKV, 1), float("nan"), dtype=torch.float16),
        torch.full((num_blocks, BS, NKV, 1), float("nan"), dtype=torch.float16),
        torch.zeros(num_blocks, BS, dtype=torch.uint8),
    ]
    k_tail = torch.full((len(segs) * width, BS, NKV, HD), float("nan"))
    v_tail = torch.full_like(k_tail, float("nan"))
    for s, seg in enumerate(segs):
        full = seg.ctx // BS
        for b in range(full):  # seal every full block, plane by plane
            span = slice(b * BS, (b + 1) * BS)
            prev_k = prev_v = None
            for j in range(PLANES):
                stored = (seg.top[span] >= j)[None]
                ids = tables[s, j, b].long()
                kc, ks, kz = kv_int4.int4_encode(seg.k[j][span][None], prev_k, stored, True, HD)
                vc, vs, vz = kv_int4.int4_encode(seg.v[j][span][None], prev_v, stored, False, HD)
                prev_k = kv_int4.int4_decode(kc, ks, kz, stored, prev_k, True, HD)
                prev_v = kv_int4.int4_decode(vc, vs, vz, stored, prev_v, False, HD)
                for field, value in zip(fields, (kc, vc, ks, kz, vs, vz, stored), strict=True):
                    field[ids] = value[0]
        for b in range(-(-seg.ctx // BS)):  # every block's exact plane in the tail (the
            # engine keeps only the open ones; the op must read no other)
            span = slice(b * BS, min((b + 1) * BS, seg.ctx))
            n = span.stop - span.start
            k_tail[tail_tables[s, b], :n] = seg.k[seg.plane][span]
            v_tail[tail_tables[s, b], :n] = seg.v[seg.plane][span]
    return segs, Int4Cache(*fields), k_tail, v_tail, tables, tail_tables


def _dense(q: torch.Tensor, segs: list[_Segment], positions: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for seg, pos in zip(segs, positions, strict=True):
        groups = -(-seg.ctx // BS)
        coded_k, coded_v = seg.k[seg.plane].clone(), seg.v[seg.plane].clone()
        for g in range(groups):
            span = slice(g * BS, (g + 1) * BS)
            if span.stop > seg.ctx:
                break
            ks = [p[span] for p in seg.k[: seg.plane + 1]]
            vs = [p[span] for p in seg.v[: seg.plane + 1]]
            coded_k[span] = oracle_codec.int4_delta_group(ks, seg.top[span], True, HD)[-1]
            coded_v[span] = oracle_codec.int4_delta_group(vs, seg.top[span], False, HD)[-1]
        for p in pos:
            own = torch.arange(p + 1) // BS == p // BS
            for h in range(q.shape[1]):
                kh, vh = h // GROUP, slice(None)
                k = torch.where(own[:, None], seg.k[seg.plane][: p + 1, kh], coded_k[: p + 1, kh])
                v = torch.where(own[:, None], seg.v[seg.plane][: p + 1, kh], coded_v[: p + 1, kh])
                w = torch.softmax(k.double() @ q[row, h].double() / math.sqrt(HD), dim=0)
                out[row, h] = w @ v[vh].double()
            row += 1
    return out


LAYOUTS = [
    [(1, 30, 3), (1, 8, 0), (1, 17, 2)],  # decode rows at different planes
    [(12, 29, 1), (5, 5, 0)],  # a chunk spanning blocks; a prompt inside one block
    [(1, 9, 3), (9, 24, 2), (0, 7, 1)],  # mixed, a segment without rows
]


@pytest.mark.unit
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int4_attention_is_the_oracles_read_back(layout: list[tuple[int, int, int]]) -> None:
    segs, cache, k_tail, v_tail, tables, tail_tables = _build(3, layout)
    gen = torch.Generator().manual_seed(9)
    rows = [r for r, _, _ in layout]
    q = torch.randn(sum(rows), NKV * GROUP, HD, generator=gen)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    ctxs = torch.tensor([c for _, c, _ in layout], dtype=torch.int32)
    planes = torch.tensor([p for _, _, p in layout], dtype=torch.int32)
    got = paged_attention_int4(
        q, cache, k_tail, v_tail, tables, tail_tables, planes, ctxs, starts, HD**-0.5, max(rows)
    )
    positions = [list(range(c - r, c)) for r, c, _ in layout]
    assert torch.allclose(got.double(), _dense(q, segs, positions), atol=1e-5, rtol=1e-5)


@pytest.mark.unit
def test_int4_attention_with_gathered_rows() -> None:
    segs, cache, k_tail, v_tail, tables, tail_tables = _build(4, [(4, 30, 2)])
    q = torch.randn(4, NKV * GROUP, HD, generator=torch.Generator().manual_seed(5))
    pos = [2, 9, 17, 29]
    got = paged_attention_int4(
        q, cache, k_tail, v_tail, tables, tail_tables, torch.tensor([2], dtype=torch.int32),
        torch.tensor([30], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
        HD**-0.5, 4, torch.tensor(pos, dtype=torch.int32),
    )  # fmt: skip
    assert torch.allclose(got.double(), _dense(q, segs, [pos]), atol=1e-5, rtol=1e-5)


def _triton_checks() -> list[str]:
    """The Triton kernel against the torch reference on every layout (interpreter only)."""
    from kernels.ops.attention_int4 import paged_attention_int4_reference
    from kernels.ops.attention_int4_triton import paged_attention_int4_triton

    found = []
    cases = [(layout, None) for layout in LAYOUTS] + [([(4, 30, 2)], [2, 9, 17, 29])]
    for i, (layout, pos) in enumerate(cases):
        _segs, cache, k_tail, v_tail, tables, tail_tables = _build(3 + i, layout)
        rows = [r for r, _, _ in layout]
        # a row before the first segment: no segment covers it, it comes out 0
        q = torch.randn(sum(rows) + 1, NKV * GROUP, HD, generator=torch.Generator().manual_seed(i))
        starts = torch.tensor([1, *(1 + torch.tensor(rows).cumsum(0)).tolist()], dtype=torch.int32)
        args = (
            q, cache.k_codes, cache.v_codes, cache.k_scale, cache.k_zero, cache.v_scale,
            cache.v_zero, cache.stored, k_tail, v_tail, tables, tail_tables,
            torch.tensor([p for _, _, p in layout], dtype=torch.int32),
            torch.tensor([c for _, c, _ in layout], dtype=torch.int32), starts, HD**-0.5,
            max(rows), None if pos is None else torch.tensor([0, *pos], dtype=torch.int32),
        )  # fmt: skip
        want = paged_attention_int4_reference(*args)
        got = paged_attention_int4_triton(*args)
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            found.append(f"case {i}: max diff {(got - want).abs().max().item()}")
        if got[0].abs().max().item() != 0.0:
            found.append(f"case {i}: the uncovered row is not 0")
    return found


@pytest.mark.unit
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_int4_attention_equals_the_reference() -> None:
    """Under TRITON_INTERPRET=1 in a fresh process (the interpreter is chosen when triton
    decorates a kernel)."""
    assert_passes_under_triton_interpreter("tests.test_kv_attention_int4")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the checks run the Triton kernel on CPU tensors")
        sys.exit(2)
    mismatches = _triton_checks()
    for line in mismatches:
        print("MISMATCH", line)
    sys.exit(1 if mismatches else 0)
