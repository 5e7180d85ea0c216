"""The fused ``torch.ops.rlt`` ops (kernels.ops).

* the torch references against independent formulas (paged attention against a dense
  per-segment loop over random segment mixes, unused cache memory NaN), and the masked exit
  copy over the worker planner's LAST_EXITED pairs against plain block/offset indexing;
* the Triton kernels against the references on CPU tensors under ``TRITON_INTERPRET=1``. The
  interpreter is chosen when triton decorates a kernel, and other tests may have imported the
  kernels without it, so those checks run in a fresh ``python -m tests.test_kernel_ops GROUP``;
* each wrapper is one op in dispatch, and the fake impls hold under ``torch.library.opcheck``;
* on a GPU (tier ``gpu``): the CUDA ops against the CPU references, and decode attention
  replayed from a CUDA graph as contexts grow.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.ops as ops
from kernels.ops import activation, attention, norms, rope_kv
from tests.helpers import assert_passes_under_triton_interpreter

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
EPS = 1e-6


def _rms_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The contract's formula, written out again."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# --- paged attention cases -----------------------------------------------------------------


@dataclass(frozen=True)
class AttnCase:
    q: torch.Tensor
    k_pool: torch.Tensor  # [2, NB, bs, nkv, hd]: the op reads the last layer (a view)
    v_pool: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    scale: float
    max_query_len: int
    layout: list[tuple[int, int]]  # (rows, context length) per segment
    keys: list[torch.Tensor]  # per segment [context, nkv, hd], as stored in the cache
    vals: list[torch.Tensor]
    # each row's own position (the op's query_pos), when some segment's rows have gaps
    query_pos: torch.Tensor | None = None
    positions: list[list[int]] | None = None  # per segment, its rows' positions

    @property
    def k_cache(self) -> torch.Tensor:
        return self.k_pool[-1]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.v_pool[-1]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start,
            self.scale,
            self.max_query_len,
            *(() if self.query_pos is None else (self.query_pos,)),
        )

    def to(self, device: str) -> AttnCase:
        names = ("q", "k_pool", "v_pool", "block_tables", "context_lens", "query_start")
        moved = {name: getattr(self, name).to(device) for name in names}
        if self.query_pos is not None:
            moved["query_pos"] = self.query_pos.to(device)
        return replace(self, **moved)


def random_layout(rng: random.Random, kind: str) -> list[tuple[int, int]]:
    """(rows, past positions) per segment."""
    if kind == "decode":
        return [(1, rng.randint(0, 40)) for _ in range(rng.randint(1, 6))]
    if kind == "prefill":  # chunks, some after earlier chunks
        return [(rng.randint(2, 20), rng.choice([0, rng.randint(1, 30)])) for _ in range(2)]
    # mixed: decode, short and long chunks, zero-row segments (with and without history)
    return [(rng.choice([0, 1, 1, 2, 5, 17]), rng.randint(0, 40)) for _ in range(rng.randint(1, 7))]


def make_attention_case(
    seed: int,
    layout: list[tuple[int, int]],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    pad_rows: int = 0,
    gathered: frozenset[int] = frozenset(),
) -> AttnCase:
    """Shuffled block tables, a NaN-filled pool with only each segment's context written, and
    NaN query rows past the segments. Unused table entries name spare all-NaN blocks, so a
    read past a context shows up as NaN in the output.

    Segments named in ``gathered`` hold their rows at ascending positions with random gaps
    (the last at the context's end), as a token-sparse loop's active tokens: the case then
    carries ``query_pos`` for every row (contiguous for the other segments)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ctxs = [n + past for n, past in layout]
    need = [-(-c // block_size) for c in ctxs]
    width = max(max(need, default=0) + rng.randint(0, 2), 1)
    spare = 2
    num_blocks = sum(need) + spare
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.tensor(free[:spare], dtype=torch.int32)[
        torch.randint(spare, (len(layout), width), generator=gen)
    ]
    free = free[spare:]
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    k_cache, v_cache = k_pool[-1], v_pool[-1]
    keys, vals = [], []
    for s, (ctx, nb) in enumerate(zip(ctxs, need, strict=True)):
        tables[s, :nb] = torch.tensor(free[:nb], dtype=torch.int32)
        free = free[nb:]
        kk = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        vv = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(ctx)
        blk = tables[s].long()[pos // block_size]
        k_cache[blk, pos % block_size] = kk
        v_cache[blk, pos % block_size] = vv
        keys.append(kk)
        vals.append(vv)
    rows = [n for n, _ in layout]
    q = torch.randn(sum(rows) + pad_rows, kv_heads * group, head_dim, generator=gen).to(dtype)
    q[sum(rows) :] = float("nan")
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    positions = []
    for s, (n, ctx) in enumerate(zip(rows, ctxs, strict=True)):
        if s in gathered and n > 0:
            positions.append([*sorted(rng.sample(range(ctx - 1), n - 1)), ctx - 1])
        else:
            positions.append(list(range(ctx - n, ctx)))
    query_pos = None
    if gathered:
        flat = [p for seg in positions for p in seg] + [0] * pad_rows
        query_pos = torch.tensor(flat, dtype=torch.int32)
    return AttnCase(
        q=q,
        k_pool=k_pool,
        v_pool=v_pool,
        block_tables=tables,
        context_lens=torch.tensor(ctxs, dtype=torch.int32),
        query_start=torch.tensor(starts, dtype=torch.int32),
        scale=1.0 / math.sqrt(head_dim),
        max_query_len=max(rows, default=0) + rng.randint(0, 1),
        layout=[(n, c) for n, c in zip(rows, ctxs, strict=True)],
        keys=keys,
        vals=vals,
        query_pos=query_pos,
        positions=positions if gathered else None,
    )


def dense_attention(case: AttnCase) -> torch.Tensor:
    """Per segment, per row, per head causal attention in float64; uncovered rows zero."""
    q = case.q.double()
    out = torch.zeros_like(q)
    group = q.shape[1] // case.k_cache.shape[2]
    row = 0
    for s, ((n, ctx), keys, vals) in enumerate(zip(case.layout, case.keys, case.vals, strict=True)):
        for i in range(n):
            visible = (ctx - n + i if case.positions is None else case.positions[s][i]) + 1
            for h in range(q.shape[1]):
                k = keys[:visible, h // group].double()
                v = vals[:visible, h // group].double()
                out[row + i, h] = torch.softmax(k @ q[row + i, h] * case.scale, dim=0) @ v
        row += n
    return out


# --- references against independent formulas ----------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 48, generator=gen) * 3).to(dtype)
    w = torch.randn(48, generator=gen).to(dtype)
    out = ops.rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, _rms_formula(x, w, EPS))
    # and what the formula means: x / rms(x) * w, computed independently in float64
    x64 = x.double()
    expected = x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * w.double()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.unit
def test_add_rms_norm_is_two_norms() -> None:
    gen = torch.Generator().manual_seed(1)
    h, a = torch.randn(7, 32, generator=gen), torch.randn(7, 32, generator=gen)
    w_out, w_next = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    h_new, x = ops.add_rms_norm(h, a, w_out, w_next, EPS)
    expected_h = h + _rms_formula(a, w_out, EPS)
    assert torch.equal(h_new, expected_h)
    assert torch.equal(x, _rms_formula(expected_h, w_next, EPS))


@pytest.mark.unit
def test_silu_mul_is_swiglu() -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(6, 2 * 24, generator=gen) * 4
    out = ops.silu_mul(gate_up)
    gate, up = gate_up[:, :24].double(), gate_up[:, 24:].double()
    assert out.shape == (6, 24)
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up)
    assert torch.equal(out, F.silu(gate_up[:, :24]) * gate_up[:, 24:])


def _rope_inputs(
    seed: int, rows: int, nh: int, nkv: int, hd: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, generator=gen).to(dtype)
    angles = torch.rand(rows, hd // 2, generator=gen) * 6.0
    emb = torch.cat((angles, angles), dim=-1)
    return qkv, emb.cos().to(dtype), emb.sin().to(dtype)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [T, heads, hd] as a rotation of (x_i, x_{i + hd/2}) pairs."""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    return torch.cat((lo * c - hi * s, hi * c + lo * s), dim=-1)


@pytest.mark.unit
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_rope_write_kv_rotates_and_writes_only_its_slots(
    block_size: int, slot_dtype: torch.dtype
) -> None:
    nh, nkv, hd, rows, num_blocks = 4, 2, 16, 7, 8
    qkv, cos, sin = _rope_inputs(block_size, rows, nh, nkv, hd)
    k_pool = torch.full((3, num_blocks, block_size, nkv, hd), float("nan"))
    v_pool = k_pool.clone()
    rng = random.Random(block_size)
    slots = rng.sample(range(num_blocks * block_size), rows)
    slots[1] = slots[4] = -1  # padding rows
    slot_mapping = torch.tensor(slots, dtype=slot_dtype)

    q = ops.rope_write_kv(qkv, cos, sin, k_pool[1], v_pool[1], slot_mapping, nh, nkv)

    q_in, k_in, v_in = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    assert q.shape == (rows, nh, hd) and q.is_contiguous()
    torch.testing.assert_close(q, _rotated(q_in.reshape(rows, nh, hd), cos, sin))
    k_rot = _rotated(k_in.reshape(rows, nkv, hd), cos, sin)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        written[blk, off] = True
        torch.testing.assert_close(k_pool[1, blk, off], k_rot[t])
        assert torch.equal(v_pool[1, blk, off], v_in[t].reshape(nkv, hd))
    # nothing else changed: unwritten slots and the other layers stay NaN
    assert k_pool[1][~written].isnan().all() and v_pool[1][~written].isnan().all()
    assert k_pool[[0, 2]].isnan().all() and v_pool[[0, 2]].isnan().all()


@pytest.mark.unit
def test_rope_write_kv_is_the_model_math_in_bf16() -> None:
    nh, nkv, hd, rows = 2, 1, 32, 5
    qkv, cos, sin = _rope_inputs(3, rows, nh, nkv, hd, torch.bfloat16)
    k_cache = torch.zeros(2, 4, nkv, hd, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.arange(rows), nh, nkv)
    x = qkv[:, : nh * hd].view(rows, nh, hd)
    rot = torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), dim=-1)
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, x * cos[:, None] + rot * sin[:, None])


LAYOUT_KINDS = ["decode", "prefill", "mixed"]
HEADS = [(1, 1), (2, 2), (1, 4)]  # (kv heads, query heads per kv head)


@pytest.mark.unit
@pytest.mark.parametrize("split_decode", [True, False], ids=["cpu-split", "one-grid"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_paged_attention_reference_matches_dense(
    block_size: int, kind: str, split_decode: bool
) -> None:
    """Both reference paths: decode and longer segments split (CPU default), and the one
    padded grid that reads no metadata on the host (the CUDA fallback)."""
    rng = random.Random(f"{block_size}-{kind}")
    for trial in range(4):
        kv_heads, group = HEADS[trial % len(HEADS)]
        case = make_attention_case(
            rng.randrange(2**31),
            random_layout(rng, kind),
            block_size,
            kv_heads,
            group,
            dtype=torch.float64 if trial % 2 else torch.float32,
            pad_rows=rng.choice([0, 0, 3]),
        )
        out = attention.paged_attention_reference(*case.args(), split_decode=split_decode)
        assert out.dtype == case.q.dtype and out.shape == case.q.shape
        tol = 1e-10 if case.q.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(out.double(), dense_attention(case), rtol=tol, atol=tol)


def gathered_layout(rng: random.Random) -> tuple[list[tuple[int, int]], frozenset[int]]:
    """A mixed layout (decode rows, prompt chunks, zero-row segments) with one or more
    segments of gathered rows (a token-sparse loop's active tokens), and which they are."""
    layout = random_layout(rng, "mixed")
    spots = sorted(rng.sample(range(len(layout) + 2), 2))
    for at in spots:
        layout.insert(at, (rng.choice([2, 3, 7, 18]), rng.randint(1, 60)))
    return layout, frozenset(spots)


@pytest.mark.unit
@pytest.mark.parametrize("split_decode", [True, False], ids=["cpu-split", "one-grid"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_reference_with_query_pos(block_size: int, split_decode: bool) -> None:
    """With query_pos each row sees keys up to its own position: segments of rows at
    ascending positions with gaps, beside ordinary chunks and decode rows."""
    rng = random.Random(f"qpos-{block_size}")
    for trial in range(6):
        kv_heads, group = HEADS[trial % len(HEADS)]
        layout, gathered = gathered_layout(rng)
        case = make_attention_case(
            rng.randrange(2**31),
            layout,
            block_size,
            kv_heads,
            group,
            dtype=torch.float64,
            pad_rows=rng.choice([0, 3]),
            gathered=gathered,
        )
        out = attention.paged_attention_reference(*case.args(), split_decode=split_decode)
        torch.testing.assert_close(out, dense_attention(case), rtol=1e-10, atol=1e-10)
        # through the op, as the model calls it
        torch.testing.assert_close(ops.paged_attention(*case.args()), out, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_paged_attention_reference_bf16_and_wide_blocks() -> None:
    layout = [(1, 300), (0, 12), (7, 40), (1, 0)]
    case = make_attention_case(5, layout, 256, kv_heads=2, group=2, dtype=torch.bfloat16)
    out = ops.paged_attention(*case.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=2e-2, atol=2e-2)


@pytest.mark.unit
@pytest.mark.parametrize("layout", [[(5, 0)], [(1, 7)] * 6, [(1, 3), (4, 2)]])
def test_paged_attention_output_is_contiguous(layout: list[tuple[int, int]]) -> None:
    """The model flattens the heads of the output with a view: it must be contiguous, for
    one prompt chunk, a decode-only pass and a mix."""
    case = make_attention_case(3, layout, 4, kv_heads=2, group=2)
    out = ops.paged_attention(*case.args())
    assert out.is_contiguous()
    out.view(out.shape[0], -1)


@pytest.mark.unit
def test_paged_attention_degenerate_batches() -> None:
    # only zero-row segments (and padding rows): all zeros, no NaN from empty softmaxes
    case = make_attention_case(6, [(0, 5), (0, 0)], 4, 1, 2, pad_rows=3)
    for split in (True, False):
        out = attention.paged_attention_reference(*case.args(), split_decode=split)
        assert torch.equal(out, torch.zeros_like(case.q)), split
    # no segments at all, and no rows at all
    q = torch.randn(2, 2, 16)
    cache = torch.zeros(3, 4, 1, 16)
    empty = torch.zeros(0, 2, dtype=torch.int32)
    out = ops.paged_attention(
        q, cache, cache, empty, empty[:, 0], torch.zeros(1, dtype=torch.int32), 0.25, 0
    )
    assert torch.equal(out, torch.zeros_like(q))
    one = make_attention_case(7, [(1, 3)], 4, 1, 2)
    no_rows = ops.paged_attention(one.q[:0], *one.args()[1:])
    assert no_rows.shape == (0, 2, 16)


@pytest.mark.unit
@pytest.mark.parametrize("contiguous", [True, False], ids=["flat", "strided"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_exit_copy_pairs_move_only_the_exited_tokens_kv(block_size: int, contiguous: bool) -> None:
    """LAST_EXITED's exit copy as the runner wires it: the planner's pairs for a decode token
    at loop e (its plane-e slot into its slots of planes e+1..D-1, as ``slot`` computes them)
    and ``copy_kv_slots_masked`` copy, in every layer, exactly the exited tokens' K/V to
    ``cache[:, table[p][pos // bs], pos % bs]`` and touch nothing else; both reference paths
    (flat slots on a contiguous CPU cache, block/offset indexing otherwise)."""
    from types import SimpleNamespace

    from services.worker.passes.pass_plan import PassPlanner  # msgspec: not on a bare GPU image

    planes, layers, kvh, hd = 4, 3, 2, 8
    planner = PassPlanner(block_size, planes, True, 0, 0, host_words=lambda n: None)
    rng = random.Random(block_size)
    gen = torch.Generator().manual_seed(block_size)
    per_table = 40 // block_size + 1  # covers positions 0..40
    tokens = 6
    num_blocks = tokens * planes * per_table + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    cases, src, dst, owner = [], [], [], []
    for t in range(tokens):
        tables = [free[(t * planes + p) * per_table :][:per_table] for p in range(planes)]
        depth, position = rng.randrange(planes), rng.randint(0, 40)
        live = SimpleNamespace(loops_run=depth + 1, depth=depth)
        live.row = SimpleNamespace(token_start=position)
        pairs = planner._pairs(live, SimpleNamespace(tables=tables))
        assert len(pairs) == planes - 1 - depth
        here = tables[depth][position // block_size] * block_size + position % block_size
        assert all(a == here for a, _ in pairs)
        cases.append((tables, depth, position))
        src += [a for a, _ in pairs]
        dst += [b for _, b in pairs]
        owner += [t] * len(pairs)
    exited = torch.tensor([rng.random() < 0.6 for _ in range(tokens)])
    shape = (layers, num_blocks, block_size, kvh, hd)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if not contiguous:
        k, v = (c.transpose(3, 4).contiguous().transpose(3, 4) for c in (k, v))
        assert not k.is_contiguous() and not v.is_contiguous()
    want_k, want_v = k.clone(), v.clone()
    for (tables, depth, position), gone in zip(cases, exited.tolist(), strict=True):
        if not gone:
            continue
        blk, off = position // block_size, position % block_size
        for p in range(depth + 1, planes):
            for want, cache in ((want_k, k), (want_v, v)):
                want[:, tables[p][blk], off] = cache[:, tables[depth][blk], off]
    ops.copy_kv_slots_masked(
        k,
        v,
        torch.tensor(src, dtype=torch.int32),
        torch.tensor(dst, dtype=torch.int32),
        exited[torch.tensor(owner, dtype=torch.int64)],
    )
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    with pytest.raises(ValueError, match="does not cover position"):
        planner.slot([0], block_size)


@pytest.mark.unit
def test_decode_split_count_depends_only_on_the_grid() -> None:
    """A static bucket (S segments) always gets the same split count, so its graph replays the
    same grid; a small grid is split up to the cap, a grid that fills the SMs is not split."""
    from kernels.ops._triton import MAX_SPLITS, decode_splits

    assert decode_splits(1, 16, 132) == MAX_SPLITS
    assert decode_splits(8, 16, 132) == 5  # 640 programs for 528 wanted
    assert decode_splits(32, 16, 132) == 2
    assert decode_splits(128, 16, 132) == 1
    assert decode_splits(0, 16, 132) == MAX_SPLITS  # no segment: nothing runs anyway
    for segs in (1, 2, 4, 8, 16, 32, 64, 128):
        splits = decode_splits(segs, 16, 132)
        assert 1 <= splits <= MAX_SPLITS and splits == decode_splits(segs, 16, 132)


# --- dispatch and fake tensors --------------------------------------------------------------


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> object:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _wrapper_calls() -> dict[str, tuple[Callable, tuple]]:
    x, w = torch.randn(3, 32), torch.randn(32)
    nh, nkv, hd = 4, 2, 16
    qkv, cos, sin = _rope_inputs(0, 3, nh, nkv, hd)
    cache = torch.zeros(2, 4, 4, nkv, hd)
    attn = make_attention_case(0, [(1, 4), (2, 0)], 4, nkv, nh // nkv)
    return {
        "rms_norm": (ops.rms_norm, (x, w, EPS)),
        "add_rms_norm": (ops.add_rms_norm, (x, x.clone(), w, w.clone(), EPS)),
        "silu_mul": (ops.silu_mul, (torch.randn(3, 64),)),
        "rope_write_kv": (
            ops.rope_write_kv,
            (qkv, cos, sin, cache[0], cache[1], torch.tensor([0, -1, 9]), nh, nkv),
        ),
        "paged_attention": (ops.paged_attention, attn.args()),
        "sample": (ops.sample, _sampler_rows(0, 10, 50)),
    }


@pytest.mark.unit
def test_each_wrapper_is_one_op_in_dispatch() -> None:
    for name, (fn, args) in _wrapper_calls().items():
        with _OpRecorder() as rec:
            fn(*args)
        assert rec.ops == [f"rlt.{name}.default"], (name, rec.ops)


@pytest.mark.unit
def test_ops_pass_opcheck() -> None:
    """Schemas (mutation declared), fake impls and aot dispatch agree with the real kernels."""
    for name, (_, args) in _wrapper_calls().items():
        torch.library.opcheck(getattr(torch.ops.rlt, name).default, args)


@pytest.mark.unit
def test_flash_decode_serves_only_the_dtype_it_was_chosen_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """flash-attn is validated at start for the model's dtype: a float32 runner in the same
    process (an oracle check beside a bf16 model) still gets the Triton kernel, and prompt
    chunks always do."""
    from kernels.ops import attention_flash

    calls: list[str] = []

    def fake(name: str) -> Callable[..., torch.Tensor]:
        return lambda q, *rest: calls.append(name) or q

    monkeypatch.setattr(attention_flash, "paged_decode", fake("flash"))
    monkeypatch.setattr(attention, "paged_attention_triton", fake("triton"))
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    rest = (None,) * 5 + (1.0,)
    attention.use_flash_decode(torch.bfloat16)
    try:
        attention._paged_attention_cuda(torch.zeros(2, 4, 8), *rest, 1)
        attention._paged_attention_cuda(torch.zeros(2, 4, 8, dtype=torch.bfloat16), *rest, 1)
        attention._paged_attention_cuda(torch.zeros(5, 4, 8, dtype=torch.bfloat16), *rest, 5)
    finally:
        attention.use_flash_decode(None)
    assert calls == ["triton", "flash", "triton"]


@pytest.mark.unit
def test_package_imports_without_triton() -> None:
    """The ops run on CPU with triton absent, and the Triton kernel modules load lazily."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton now raises ImportError\n"
        "import torch, kernels.ops as ops\n"
        "assert not ops.triton_available()\n"
        "lazy = ('norms', 'activation', 'rope_kv', 'attention', 'sample')\n"
        "loaded = [m for m in lazy if f'kernels.ops.{m}_triton' in sys.modules]\n"
        "assert not loaded, f'kernel modules imported eagerly: {loaded}'\n"
        "x = torch.randn(2, 8)\n"
        "assert ops.rms_norm(x, torch.ones(8), 1e-6).shape == x.shape\n"
        "assert ops.silu_mul(x).shape == (2, 4)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# --- Triton kernels under the interpreter ---------------------------------------------------


def _close(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: float, failures: list[str]
) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
        return
    g, w = got.double(), want.double()
    both_nan = g.isnan() & w.isnan()
    err = ((g - w).abs() - tol * (1 + w.abs())).masked_fill(both_nan, 0)
    if err.isnan().any():
        failures.append(f"{name}: NaN where the other side is finite ({int(err.isnan().sum())})")
    elif (err > 0).any():
        worst = (g - w).abs().masked_fill(both_nan, 0).max().item()
        failures.append(f"{name}: max abs diff {worst:.3g} over tolerance {tol:g}")


# Interpreter casts to bf16 truncate (the GPU rounds to nearest), so bf16 gets a few ulps.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _check_norms(failures: list[str]) -> None:
    rng = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(4):
            rows, width = rng.randint(1, 9), rng.choice([16, 48, 100, 256])
            gen = torch.Generator().manual_seed(rng.randrange(2**31))
            h, a, x = (torch.randn(rows, width, generator=gen).to(dtype) for _ in range(3))
            w1, w2 = (torch.randn(width, generator=gen).to(dtype) for _ in range(2))
            tol, tag = TOLERANCE[dtype], f"{dtype} {rows}x{width}"
            want = norms.rms_norm_reference(x, w1, EPS)
            _close(f"rms_norm {tag}", norms.rms_norm_triton(x, w1, EPS), want, tol, failures)
            got = norms.add_rms_norm_triton(h, a, w1, w2, EPS)
            want2 = norms.add_rms_norm_reference(h, a, w1, w2, EPS)
            for part, g, w in zip(("h_new", "x"), got, want2, strict=True):
                _close(f"add_rms_norm {part} {tag}", g, w, tol, failures)
        empty = torch.zeros(0, 16, dtype=dtype)
        _close("rms_norm 0 rows", norms.rms_norm_triton(empty, w1[:16], EPS), empty, 0, failures)


def _check_activation(failures: list[str]) -> None:
    rng = random.Random(1)
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(4):
            rows, width = rng.randint(1, 9), rng.choice([8, 40, 1500])
            gen = torch.Generator().manual_seed(rng.randrange(2**31))
            gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
            _close(
                f"silu_mul {dtype} {rows}x{width}",
                activation.silu_mul_triton(gate_up),
                activation.silu_mul_reference(gate_up),
                TOLERANCE[dtype],
                failures,
            )


def _check_rope(failures: list[str]) -> None:
    rng = random.Random(2)
    for dtype in (torch.float32, torch.bfloat16):
        for block_size in (1, 4, 16):
            nkv = rng.choice([1, 2])
            nh, hd, rows = nkv * rng.choice([1, 2]), rng.choice([16, 32, 64]), rng.randint(1, 9)
            num_blocks = -(-rows // block_size) + 2
            qkv, cos, sin = _rope_inputs(rng.randrange(2**31), rows, nh, nkv, hd, dtype)
            slots = rng.sample(range(num_blocks * block_size), rows)
            for t in rng.sample(range(rows), rows // 3):
                slots[t] = -1
            slot_mapping = torch.tensor(slots, dtype=rng.choice([torch.int64, torch.int32]))
            results = []
            for impl in (rope_kv.rope_write_kv_triton, rope_kv.rope_write_kv_reference):
                pool = torch.full((2, 2, num_blocks, block_size, nkv, hd), float("nan"))
                pool = pool.to(dtype)
                q = impl(qkv, cos, sin, pool[0, 1], pool[1, 1], slot_mapping, nh, nkv)
                results.append((q, pool))
            (q_t, pool_t), (q_r, pool_r) = results
            tag = f"{dtype} bs={block_size} nh={nh} nkv={nkv} hd={hd}"
            _close(f"rope q {tag}", q_t, q_r, TOLERANCE[dtype], failures)
            _close(f"rope caches {tag}", pool_t, pool_r, TOLERANCE[dtype], failures)


def _check_attention(failures: list[str]) -> None:
    rng = random.Random(3)
    # (dtype, kernel): bf16 tl.dot is wrong in the interpreter (it multiplies the raw bits),
    # so the dot kernel's low-precision run is fp16; the GPU tier covers bf16.
    runs = [
        (torch.float32, False),
        (torch.float32, True),
        (torch.bfloat16, False),
        (torch.float16, True),
    ]
    for dtype, tiled in runs:
        for block_size in (1, 4, 16):
            kind = rng.choice(LAYOUT_KINDS) if not tiled else rng.choice(["prefill", "mixed"])
            kv_heads, group = rng.choice(HEADS)
            case = make_attention_case(
                rng.randrange(2**31),
                random_layout(rng, kind),
                block_size,
                kv_heads,
                group,
                head_dim=rng.choice([16, 32]),
                dtype=dtype,
                pad_rows=rng.choice([0, 2]),
            )
            tag = f"{dtype} tiled={tiled} bs={block_size} layout={case.layout}"
            got = attention.paged_attention_triton(*case.args(), tiled=tiled)
            want = attention.paged_attention_reference(*case.args())
            _close(f"paged_attention {tag}", got, want, TOLERANCE[dtype], failures)
    # the default choice (tl.dot from 16 query rows on), and 256-slot blocks
    case = make_attention_case(9, [(17, 5), (1, 300), (0, 3)], 256, 2, 2, head_dim=32)
    got = attention.paged_attention_triton(*case.args())
    want = attention.paged_attention_reference(*case.args())
    _close("paged_attention default bs=256", got, want, TOLERANCE[torch.float32], failures)


def _check_attention_query_pos(failures: list[str]) -> None:
    """Both prompt kernels with query_pos: gathered rows with gaps (more than one query tile
    of them too) mixed with prompt chunks, decode rows and zero-row segments, against the
    reference and the float64 dense formula; and one-row segments (the decode kernel)."""
    rng = random.Random(11)
    runs = [(torch.float32, False), (torch.float32, True), (torch.float16, True)]
    for dtype, tiled in runs:
        for block_size in (1, 4, 16):
            kv_heads, group = rng.choice(HEADS)
            layout, gathered = gathered_layout(rng)
            if tiled and block_size == 4:  # a segment of more than one 64-row query tile
                layout.append((70, 90))
                gathered |= {len(layout) - 1}
            case = make_attention_case(
                rng.randrange(2**31),
                layout,
                block_size,
                kv_heads,
                group,
                head_dim=rng.choice([16, 32]),
                dtype=dtype,
                pad_rows=rng.choice([0, 2]),
                gathered=gathered,
            )
            tag = f"query_pos {dtype} tiled={tiled} bs={block_size} layout={case.layout}"
            got = attention.paged_attention_triton(*case.args(), tiled=tiled)
            want = attention.paged_attention_reference(*case.args())
            _close(tag, got, want, TOLERANCE[dtype], failures)
            _close(
                f"{tag} vs dense", got, dense_attention(case).to(dtype), TOLERANCE[dtype], failures
            )
    # the default kernel choice for a few gathered rows (the tiled one)
    case = make_attention_case(
        22, [(3, 9), (1, 5), (2, 0)], 4, 2, 2, head_dim=32, gathered=frozenset({0})
    )
    got = attention.paged_attention_triton(*case.args())
    _close("query_pos default kernel", got, dense_attention(case).float(), 1e-5, failures)
    case = make_attention_case(
        21, [(1, 9), (0, 4), (1, 30), (1, 0)], 4, 2, 2, head_dim=32, gathered=frozenset({0, 2})
    )
    case = replace(case, max_query_len=1)
    got = attention.paged_attention_triton(*case.args())
    _close("query_pos one-row segments", got, dense_attention(case).float(), 1e-5, failures)


# (layout, block size, splits, split alignment): contexts of 1, splits left empty by short
# contexts, split boundaries inside a block (alignments that do not divide the block size),
# zero-row segments, and one split (the kernel writes the output itself)
DECODE_CASES = [
    ([(1, 0)], 4, 4, 1),
    ([(1, 0), (1, 0), (0, 0)], 16, 2, 64),
    ([(1, 0), (1, 5), (0, 3), (1, 63)], 16, 8, 1),
    ([(1, 100), (1, 1)], 16, 3, 5),
    ([(1, 300), (1, 7), (0, 12)], 256, 4, 64),
    ([(1, 40)], 1, 2, 16),
    ([(1, 129), (1, 2)], 16, 32, 7),
    ([(1, 2), (1, 2), (1, 2)], 4, 1, 64),
    ([(1, 77), (1, 33)], 16, 5, 64),
]


class _Launches(TorchDispatchMode):
    """Torch ops a call makes (the Triton launches themselves are invisible to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _check_attention_decode(failures: list[str]) -> None:
    """The split-context decode kernel against the reference and the float64 dense formula:
    float32 tight, bf16 loose; padding rows past the segments come out zero with no memset."""
    for i, (layout, block_size, splits, align) in enumerate(DECODE_CASES):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, TOLERANCE[torch.bfloat16])):
            kv_heads, group = HEADS[i % len(HEADS)]
            case = make_attention_case(
                1000 + i, layout, block_size, kv_heads, group, head_dim=32, dtype=dtype, pad_rows=2
            )
            case = replace(case, max_query_len=1)
            tag = f"decode {dtype} bs={block_size} splits={splits} align={align} {layout}"
            with _Launches() as launches:
                got = attention.paged_attention_triton(
                    *case.args(), num_splits=splits, split_align=align
                )
            memsets = [op for op in launches.ops if "zero" in op or "fill" in op]
            if memsets:
                failures.append(f"{tag}: memsets {memsets}")
            want = attention.paged_attention_reference(*case.args())
            _close(tag, got, want, tol, failures)
            _close(f"{tag} vs dense", got, dense_attention(case).to(dtype), tol, failures)
            if not torch.equal(got[sum(n for n, _ in layout) :], torch.zeros_like(got[:2])):
                failures.append(f"{tag}: padding rows are not zero")
    # the default split count on a wide grid of one row, and with many rows (one split)
    for layout in ([(1, 200)], [(1, 9)] * 40):
        case = replace(make_attention_case(7, layout, 16, 2, 2, head_dim=32), max_query_len=1)
        got = attention.paged_attention_triton(*case.args())
        want = attention.paged_attention_reference(*case.args())
        _close(f"decode default splits {len(layout)} rows", got, want, 1e-5, failures)


def _sampler_rows(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Logits and sampling params covering the sampler's branches: bf16-rounded logits (many
    exact ties), a row of one value, -inf and NaN logits, greedy rows, temperatures that
    overflow or are not positive, top-k at 1, V - 1, V and off, top-p at 0, near 1 and off,
    64-bit seeds and indices."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = (
        torch.randn(rows, vocab, generator=gen)
        * torch.tensor([rng.choice([0.5, 3.0, 12.0]) for _ in range(rows)])[:, None]
    )
    logits = logits.to(torch.bfloat16).float()
    logits[1] = 0.25  # every token tied
    logits[2, ::3] = float("-inf")
    logits[3, rng.randrange(vocab)] = float("nan")
    temps = [0.8] * rows
    for i, t in ((0, 0.0), (4, 1e-38), (5, -1.0), (6, 0.0), (7, float("nan")), (8, 1.7)):
        temps[i % rows] = t
    top_k = [rng.choice([0, 1, 5, 40, vocab - 1, vocab, vocab + 3]) for _ in range(rows)]
    top_p = [rng.choice([1.0, 0.9, 0.5, 0.0, 0.999999, 0.3]) for _ in range(rows)]
    top_k[9 % rows], top_p[9 % rows] = 40, 0.9  # the sampled row
    return (
        logits,
        torch.tensor(temps, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int32),
        torch.tensor(top_p, dtype=torch.float32),
        torch.randint(-(2**62), 2**62, (rows,), generator=gen),
        torch.randint(0, 2**40, (rows,), generator=gen),
    )


def _check_sample(failures: list[str]) -> None:
    """The sort-free Triton sampler draws the reference's token and flags the same bad rows;
    on rows that filter, its threshold is the reference's to the bit."""
    sample = importlib.import_module("kernels.ops.sample")  # the package's ``sample`` is the op
    sample_triton = importlib.import_module("kernels.ops.sample_triton")
    for seed, rows, vocab in ((0, 12, 200), (1, 12, 333), (2, 10, 2500)):
        args = _sampler_rows(seed, rows, vocab)
        if seed == 1:  # float64 temperatures, as sample_token passes them
            args = (args[0], args[1].double(), *args[2:])
        logits, temperature, top_k, top_p = args[:4]
        ids, bad, threshold = sample_triton.sample(*args)
        want_ids, want_bad = sample.sample_reference(*args, filters=True)
        tag = f"sample seed={seed} {rows}x{vocab}"
        if not torch.equal(bad, want_bad):
            failures.append(f"{tag}: bad {bad.tolist()} vs {want_bad.tolist()}")
        if not torch.equal(ids, want_ids):
            failures.append(f"{tag}: ids {ids.tolist()} vs {want_ids.tolist()}")
        divisor = torch.where(temperature == 0, 1.0, temperature).to(torch.float32)
        want = sample.filter_threshold(logits / divisor[:, None], top_k, top_p)[:, 0]
        for i in range(rows):
            if temperature[i] != 0 and not want_bad[i] and threshold[i] != want[i]:
                failures.append(f"{tag} row {i}: threshold {threshold[i]} vs {want[i]}")


def _check_exit_rule(failures: list[str]) -> None:
    module = importlib.import_module("kernels.ops.exit_rule")

    g = torch.Generator().manual_seed(5)
    n = 700  # several programs, the last one partial
    args = (
        torch.randn(n, generator=g) * 4,
        torch.rand(n, generator=g),
        torch.randint(1, 5, (n,), generator=g, dtype=torch.int32),
        torch.randint(1, 5, (n,), generator=g, dtype=torch.int32),
        torch.randint(1, 5, (n,), generator=g, dtype=torch.int32),
        torch.where(torch.rand(n, generator=g) < 0.2, 1.0, torch.rand(n, generator=g)),
        torch.where(
            torch.rand(n, generator=g) < 0.2,
            torch.randint(1, 5, (n,), generator=g, dtype=torch.int32),
            0,
        ).to(torch.int32),
    )
    want_survived, want_exit = module.exit_rule_reference(*args)
    got_survived, got_exit = module.exit_rule_triton(*args)
    _close("exit_rule survival", got_survived, want_survived, TOLERANCE[torch.float32], failures)
    # the interpreter's exp may differ from torch's in the last bit: exits agree away from it
    near = ((1.0 - want_survived) - args[5]).abs() < 1e-5
    if not torch.equal(got_exit[~near], want_exit[~near]):
        failures.append("exit_rule: exit flags differ away from the threshold")


def _check_kv_copy(failures: list[str]) -> None:
    module = importlib.import_module("kernels.ops.kv_copy")

    g = torch.Generator().manual_seed(6)
    for block_size in (1, 4, 16):
        shape = (3, 40 // block_size + 2, block_size, 2, 16)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        slots = torch.randperm(shape[1] * block_size, generator=g)[:24]
        src, dst = slots[:12], slots[12:]
        mask = torch.rand(12, generator=g) < 0.5
        want_k, want_v = k.clone(), v.clone()
        module.copy_kv_slots_masked_reference(want_k, want_v, src, dst, mask)
        module.copy_kv_slots_masked_triton(k, v, src, dst, mask)
        if not (torch.equal(k, want_k) and torch.equal(v, want_v)):
            failures.append(f"copy_kv_slots_masked bs={block_size}: caches differ")


INTERPRETER_CHECKS: dict[str, Callable[[list[str]], None]] = {
    "exit_rule": _check_exit_rule,
    "kv_copy": _check_kv_copy,
    "norms": _check_norms,
    "activation": _check_activation,
    "rope": _check_rope,
    "attention": _check_attention,
    "attention_decode": _check_attention_decode,
    "attention_query_pos": _check_attention_query_pos,
    "sample": _check_sample,
}


@pytest.mark.unit
@pytest.mark.parametrize("group", sorted(INTERPRETER_CHECKS))
def test_triton_kernels_match_references_under_interpreter(group: str) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    assert_passes_under_triton_interpreter("tests.test_kernel_ops", group)


# --- every Triton kernel compiled for Hopper, without a GPU ---------------------------------

_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "enable_reflect_ftz")


def _record_launches(calls: Callable[[], None]) -> list[tuple]:
    """The (kernel, args, kwargs) of every Triton launch ``calls`` makes; nothing runs."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple] = []
    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(  # type: ignore[method-assign]
        (self, args, kwargs)
    )
    try:
        calls()
    finally:
        JITFunction.run = run  # type: ignore[method-assign]
    return launches


def _compile_for_hopper(kernel, args: tuple, kwargs: dict) -> str:  # type: ignore[no-untyped-def]
    """Compiles one recorded launch to an sm_90 cubin (Triton's bundled ptxas): type errors,
    unsupported ops and register allocation failures show up here, as on the GPU. Returns
    the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constexprs = {
        name: True if name == "LIBDEVICE" else value
        for name, value in kwargs.items()
        if name not in _LAUNCH_OPTIONS
    }
    signature: dict[str, str] = {}
    values = iter(args)
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = next(values)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
    )
    options = {k: v for k, v in kwargs.items() if k in _LAUNCH_OPTIONS}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _ouro_shaped_launches() -> None:
    """Each wrapper at Ouro-1.4B's shapes (bf16, 16 heads of 128), every kernel variant."""
    dtype, nh, hd, bs = torch.bfloat16, 16, 128, 16
    x = torch.randn(4, 2048).to(dtype)
    w = torch.randn(2048).to(dtype)
    norms.rms_norm_triton(x, w, EPS)
    norms.add_rms_norm_triton(x, x, w, w, EPS)
    activation.silu_mul_triton(torch.randn(4, 2 * 5504).to(dtype))
    qkv, cos, sin = _rope_inputs(0, 4, nh, nh, hd, dtype)
    cache = torch.zeros(2, 8, bs, nh, hd, dtype=dtype)
    rope_kv.rope_write_kv_triton(qkv, cos, sin, cache[0], cache[1], torch.arange(4), nh, nh)
    for layout, max_q in (([(1, 40), (1, 3)], 1), ([(3, 5), (1, 9)], 3), ([(20, 4)], 20)):
        case = replace(make_attention_case(0, layout, bs, nh, 1, hd, dtype), max_query_len=max_q)
        attention.paged_attention_triton(*case.args())
        if max_q == 1:
            attention.paged_attention_triton(*case.args(), num_splits=1)
    # gathered rows (query_pos), per-query and tiled
    case = make_attention_case(0, [(3, 9), (20, 30)], bs, nh, 1, hd, dtype, gathered=frozenset({1}))
    for tiled in (False, True):
        attention.paged_attention_triton(*case.args(), tiled=tiled)
    importlib.import_module("kernels.ops.exit_rule").exit_rule_triton(
        torch.randn(3), torch.rand(3), *(torch.ones(3, dtype=torch.int32),) * 3,
        torch.rand(3), torch.zeros(3, dtype=torch.int32),
    )  # fmt: skip
    pairs = torch.arange(4, dtype=torch.int32)
    importlib.import_module("kernels.ops.kv_copy").copy_kv_slots_masked_triton(
        cache.clone(), cache.clone(), pairs, pairs, torch.ones(4, dtype=torch.bool)
    )
    sampler_args = _sampler_rows(0, 4, 49152)
    sample_triton = importlib.import_module("kernels.ops.sample_triton")
    sample_triton.sample(*sampler_args)
    sample_triton.sample(sampler_args[0], sampler_args[1].double(), *sampler_args[2:])


def _no_ex2(ptx: str) -> str:
    """The PTX without its ex2.approx instructions: every expf uses the flushing one inside
    (nvcc's and libdevice's alike), so it says nothing about the build."""
    return re.sub(r"ex2\.approx\.ftz\.f32", "", ptx)


def _compile_main() -> int:
    """``python -m tests.test_kernel_ops compile``: every kernel the wrappers launch at
    Ouro's shapes, compiled for sm_90."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the check compiles the kernels")
        return 2
    launches = _record_launches(_ouro_shaped_launches)
    failures = []
    for kernel, args, kwargs in launches:
        try:
            ptx = _compile_for_hopper(kernel, args, kwargs)
        except Exception as exc:
            failures.append(f"{kernel.__name__}: {type(exc).__name__}: {str(exc)[-2000:]}")
            continue
        # the sampler's libdevice exp/log must be torch's (nvcc's default keeps subnormals);
        # Triton links libdevice flushing them to zero unless told not to
        if kernel.__name__ == "_sample_kernel" and re.search(r"\.ftz\.f32", _no_ex2(ptx)):
            failures.append(f"{kernel.__name__}: libdevice compiled flush-to-zero")
    print(f"compiled {len(launches) - len(failures)}/{len(launches)} launches for sm_90")
    for line in failures:
        print("COMPILE FAILED", line)
    return 1 if failures or not launches else 0


@pytest.mark.unit
def test_triton_kernels_compile_for_hopper() -> None:
    """Every kernel, as the wrappers launch it at Ouro's shapes, compiles to an sm_90 cubin
    here (no GPU needed: Triton ships ptxas). The GPU image's Triton is older: an API it
    lacks would still only show on a GPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_kernel_ops", "compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def _interpreter_main(groups: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the checks run the Triton kernels on CPU tensors")
        return 2
    unknown = sorted(set(groups) - set(INTERPRETER_CHECKS))
    if unknown:
        print(f"unknown check groups {unknown}; known: {sorted(INTERPRETER_CHECKS)}")
        return 2
    failures: list[str] = []
    for group in groups or sorted(INTERPRETER_CHECKS):
        INTERPRETER_CHECKS[group](failures)
    for line in failures:
        print("MISMATCH", line)
    return 1 if failures else 0


# --- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_match_cpu_references(dtype: torch.dtype) -> None:
    assert ops.triton_available(), "the GPU image should have triton"
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    failures: list[str] = []
    gen = torch.Generator().manual_seed(0)
    x, a = (torch.randn(37, 2048, generator=gen).to(dtype) for _ in range(2))
    w1, w2 = (torch.randn(2048, generator=gen).to(dtype) for _ in range(2))
    _close(
        "rms_norm",
        ops.rms_norm(x.cuda(), w1.cuda(), EPS).cpu(),
        ops.rms_norm(x, w1, EPS),
        tol,
        failures,
    )
    got = ops.add_rms_norm(x.cuda(), a.cuda(), w1.cuda(), w2.cuda(), EPS)
    for part, g, w in zip(("h_new", "x"), got, ops.add_rms_norm(x, a, w1, w2, EPS), strict=True):
        _close(f"add_rms_norm {part}", g.cpu(), w, tol, failures)
    gate_up = torch.randn(37, 2 * 5504, generator=gen).to(dtype)
    _close("silu_mul", ops.silu_mul(gate_up.cuda()).cpu(), ops.silu_mul(gate_up), tol, failures)

    nh, nkv, hd, rows, bs = 16, 16, 128, 37, 16
    qkv, cos, sin = _rope_inputs(1, rows, nh, nkv, hd, dtype)
    slot_mapping = torch.randperm(8 * bs, generator=gen)[:rows]
    slot_mapping[::5] = -1
    outs = []
    for dev in ("cpu", "cuda"):
        pool = torch.full((2, 3, 8, bs, nkv, hd), float("nan"), dtype=dtype, device=dev)
        q = ops.rope_write_kv(
            qkv.to(dev),
            cos.to(dev),
            sin.to(dev),
            pool[0, 1],
            pool[1, 1],
            slot_mapping.to(dev),
            nh,
            nkv,
        )
        outs.append((q.cpu(), pool.cpu()))
    _close("rope q", outs[1][0], outs[0][0], tol, failures)
    _close("rope caches", outs[1][1], outs[0][1], tol, failures)

    rng = random.Random(4)
    for block_size in (1, 16, 256):
        for kind in LAYOUT_KINDS:
            for head_dim in (64, 128):
                case = make_attention_case(
                    rng.randrange(2**31),
                    random_layout(rng, kind),
                    block_size,
                    2,
                    4,
                    head_dim=head_dim,
                    dtype=dtype,
                    pad_rows=2,
                )
                got = ops.paged_attention(*case.to("cuda").args()).cpu()
                want = ops.paged_attention(*case.args())
                _close(
                    f"paged_attention bs={block_size} {kind} hd={head_dim}",
                    got,
                    want,
                    tol,
                    failures,
                )
    # long contexts in shuffled blocks: the split decode kernel's default split counts
    from kernels.ops.paged_case import paged_decode_case

    for rows, context in ((1, 5000), (8, 700), (33, 257)):
        long = paged_decode_case(rows, context, 16, 16, 128, 16, dtype, "cuda", pad_rows=2)
        got = ops.paged_attention(*long.args()).cpu()
        want = ops.paged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in long.args()))
        _close(f"decode {rows} rows x {context}", got, want, tol, failures)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@requires_cuda
def test_cuda_triton_sampler_draws_the_references_tokens() -> None:
    """On the GPU the sort-free sampler and the torch reference agree on every probe row
    (the start-up check that picks the sampler runs the same comparison)."""
    from kernels.ops import backends

    sample = importlib.import_module("kernels.ops.sample")
    for vocab in (49152, 151_936):
        args = backends.sampler_probe(vocab, torch.device("cuda"))
        got = sample.sample_triton(*args)
        want = sample.sample_reference(*args, filters=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), vocab


@pytest.mark.gpu
@requires_cuda
def test_decode_attention_replays_from_a_cuda_graph() -> None:
    """Capture once at max_query_len 1, then grow every context and replay: the kernel reads
    the new lengths and tables from the same buffers."""
    dtype, block_size = torch.bfloat16, 16
    first = make_attention_case(11, [(1, 20), (1, 3), (0, 9)], block_size, 2, 2, 64, dtype, 2)
    grown = make_attention_case(12, [(1, 70), (1, 40), (1, 15)], block_size, 2, 2, 64, dtype, 1)
    # one pool big enough for both; the captured tensors are updated in place
    static = first.to("cuda")
    later = grown.to("cuda")
    num_blocks = max(static.k_cache.shape[0], later.k_cache.shape[0])
    pool = torch.full((2, num_blocks, block_size, 2, 64), float("nan"), dtype=dtype, device="cuda")
    tables = torch.zeros(
        3,
        max(static.block_tables.shape[1], later.block_tables.shape[1]),
        dtype=torch.int32,
        device="cuda",
    )

    def load(case: AttnCase) -> None:
        pool.fill_(float("nan"))
        pool[0, : case.k_cache.shape[0]] = case.k_cache
        pool[1, : case.v_cache.shape[0]] = case.v_cache
        tables.zero_()
        tables[:, : case.block_tables.shape[1]] = case.block_tables
        static.q.copy_(case.q)
        static.context_lens.copy_(case.context_lens)
        static.query_start.copy_(case.query_start)

    def run() -> torch.Tensor:
        return ops.paged_attention(
            static.q,
            pool[0],
            pool[1],
            tables,
            static.context_lens,
            static.query_start,
            static.scale,
            1,
        )

    load(static)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for case, host in ((static, first), (later, grown)):
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        host_case = replace(host, max_query_len=1)
        torch.testing.assert_close(
            out.cpu().double(), dense_attention(host_case), rtol=3e-2, atol=3e-2
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["compile"]:
        sys.exit(_compile_main())
    sys.exit(_interpreter_main(sys.argv[1:]))
