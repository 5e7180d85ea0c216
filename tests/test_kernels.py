"""Tests for the torch reference kernels: paged attention, KV writes and the exit copy."""

from __future__ import annotations

import importlib
import math
import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import (
    Segment,
    build_attention_metadata,
    copy_kv_slots,
    exit_copy_slots,
    flash_attn_available,
    paged_attention,
    slot_of,
    write_kv,
)

pytestmark = pytest.mark.unit

HEAD_DIM = 8
# The module itself: the package attribute of this name is the re-exported function.
paged_attention_module = importlib.import_module("kernels.paged_attention")


def _make_case(
    layout: list[tuple[int, int]],
    block_size: int,
    kv_heads: int,
    group: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
) -> dict:
    """Random packed batch: segments with shuffled, non-contiguous block tables and history.

    ``layout`` holds (num_rows, pos_start) per segment in row order. Unused cache memory is
    NaN so any read of an unwritten slot (e.g. through padding) poisons the result.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(p + n) // block_size) + rng.randint(0, 2) for n, p in layout]  # + slack
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    segments, row = [], 0
    for (n, p), nb in zip(layout, need, strict=True):
        table, perm = perm[:nb], perm[nb:]
        segments.append(Segment(row_start=row, num_rows=n, pos_start=p, block_table=table))
        row += n
    num_rows = row
    num_heads = kv_heads * group

    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    hist_k: dict[int, torch.Tensor] = {}  # keyed by row_start
    hist_v: dict[int, torch.Tensor] = {}
    for seg in segments:
        hk = torch.randn(seg.pos_start, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        hv = torch.randn(seg.pos_start, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        for pos in range(seg.pos_start):
            s = slot_of(seg.block_table, pos, block_size)
            k_cache[s // block_size, s % block_size] = hk[pos].to(dtype)
            v_cache[s // block_size, s % block_size] = hv[pos].to(dtype)
        hist_k[seg.row_start], hist_v[seg.row_start] = hk, hv
    q = torch.randn(num_rows, num_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(num_rows, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(num_rows, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    rng.shuffle(segments)  # segment order must not matter
    return {
        "segments": segments,
        "num_rows": num_rows,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "hist_k": hist_k,
        "hist_v": hist_v,
        "q": q,
        "k": k,
        "v": v,
        "group": group,
    }


def _dense_reference(case: dict) -> torch.Tensor:
    """Plain per-segment, per-row causal attention in float64."""
    q, k, v, group = case["q"], case["k"], case["v"], case["group"]
    out = torch.zeros_like(q)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    for seg in case["segments"]:
        rows = slice(seg.row_start, seg.row_start + seg.num_rows)
        keys = torch.cat([case["hist_k"][seg.row_start], k[rows]])  # positions 0..end
        vals = torch.cat([case["hist_v"][seg.row_start], v[rows]])
        for i in range(seg.num_rows):
            r = seg.row_start + i
            visible = seg.pos_start + i + 1
            for h in range(q.shape[1]):
                kh = h // group
                scores = keys[:visible, kh] @ q[r, h] * scale
                out[r, h] = torch.softmax(scores, dim=0) @ vals[:visible, kh]
    return out


def _run(case: dict, block_size: int) -> torch.Tensor:
    meta = build_attention_metadata(case["segments"], block_size, case["num_rows"])
    dtype = case["k_cache"].dtype
    write_kv(case["k_cache"], case["v_cache"], meta.slot_mapping, case["k"], case["v"])
    q = case["q"].to(dtype)
    return paged_attention(q, case["k_cache"], case["v_cache"], meta, 1.0 / math.sqrt(HEAD_DIM))


layouts = st.lists(
    st.tuples(
        st.one_of(st.just(1), st.integers(1, 7)),  # decode-heavy mix of row counts
        st.integers(0, 40),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(
    layout=layouts,
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_dense(
    layout: list[tuple[int, int]], block_size: int, kv_heads: int, group: int, seed: int
) -> None:
    case = _make_case(layout, block_size, kv_heads, group, seed)
    out = _run(case, block_size)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _dense_reference(case), rtol=1e-10, atol=1e-10)


def test_paged_attention_low_precision_dtype() -> None:
    layout = [(1, 9), (5, 3), (1, 0), (3, 17)]
    case = _make_case(layout, 4, kv_heads=2, group=2, seed=7, dtype=torch.bfloat16)
    out = _run(case, 4)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    # Reference on the bf16-rounded inputs; only the output rounding differs materially.
    for key in ("q", "k", "v"):
        case[key] = case[key].to(torch.bfloat16).double()
    for key in ("hist_k", "hist_v"):
        case[key] = {r: t.to(torch.bfloat16).double() for r, t in case[key].items()}
    torch.testing.assert_close(out.double(), _dense_reference(case), rtol=2e-2, atol=2e-2)


def test_metadata_slots_and_positions() -> None:
    segs = [
        Segment(row_start=2, num_rows=3, pos_start=4, block_table=[7, 2]),
        Segment(row_start=0, num_rows=2, pos_start=0, block_table=[5]),
        Segment(row_start=5, num_rows=1, pos_start=6, block_table=[1, 3, 9]),
    ]
    meta = build_attention_metadata(segs, block_size=4, num_rows=6)
    assert meta.positions.tolist() == [0, 1, 4, 5, 6, 6]
    assert meta.slot_mapping.tolist() == [20, 21, 8, 9, 10, 14]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.num_segments == 3
    assert meta.max_block_id == 7  # block 9 of the last table is beyond its used prefix


def test_causal_within_segment() -> None:
    bs, kvh, heads = 4, 2, 4
    seg = Segment(row_start=0, num_rows=6, pos_start=3, block_table=[4, 0, 2])
    meta = build_attention_metadata([seg], bs, 6)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, heads, HEAD_DIM, generator=gen)
    k = torch.randn(6, kvh, HEAD_DIM, generator=gen)
    v = torch.randn(6, kvh, HEAD_DIM, generator=gen)
    hist = torch.randn(2, 5, bs, kvh, HEAD_DIM, generator=gen)

    def attend(v_rows: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = hist[0].clone(), hist[1].clone()
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v_rows)
        return paged_attention(q, k_cache, v_cache, meta, 0.5)

    base = attend(v)
    v2 = v.clone()
    v2[3] += 10.0  # perturb a later row's V
    pert = attend(v2)
    torch.testing.assert_close(pert[:3], base[:3], rtol=0, atol=0)  # earlier rows blind to it
    assert not torch.allclose(pert[3:], base[3:])  # it and later rows see it


def test_empty_batch() -> None:
    meta = build_attention_metadata([], block_size=4, num_rows=0)
    assert meta.slot_mapping.shape == (0,)
    k_cache = torch.zeros(3, 4, 2, HEAD_DIM)
    v_cache = torch.zeros(3, 4, 2, HEAD_DIM)
    empty_kv = torch.zeros(0, 2, HEAD_DIM)
    write_kv(k_cache, v_cache, meta.slot_mapping, empty_kv, empty_kv)
    out = paged_attention(torch.zeros(0, 4, HEAD_DIM), k_cache, v_cache, meta, 1.0)
    assert out.shape == (0, 4, HEAD_DIM)


def test_mixed_layout_runs_per_bucket() -> None:
    """Decode rows next to a long prefill chunk go through separate query-length buckets
    (instead of padding every decode row to the chunk's length) and still match."""
    layout = [(1, 57), (1, 60), (40, 0), (1, 3), (1, 62), (2, 58), (1, 61)]
    case = _make_case(layout, block_size=4, kv_heads=2, group=2, seed=11)
    meta = build_attention_metadata(case["segments"], 4, case["num_rows"])
    assert len(meta.buckets) >= 2
    assert sum(b.num_rows for b in meta.buckets) == case["num_rows"]
    assert max(b.q_max for b in meta.buckets if b.num_segments > 1) < 40
    ref = _dense_reference(case)
    torch.testing.assert_close(_run(case, 4), ref, rtol=1e-10, atol=1e-10)
    # The full-grid view (flash reads it) equals the unbucketed build's.
    flat = build_attention_metadata(case["segments"], 4, case["num_rows"], bucketed=False)
    assert len(flat.buckets) == 1
    for name in ("query_rows", "context_slots", "mask", "row_to_padded", "context_lens"):
        assert torch.equal(getattr(meta, name), getattr(flat, name)), name


@settings(max_examples=25, deadline=None)
@given(layout=layouts, block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_paged_attention_every_size_class_its_own_bucket(
    layout: list[tuple[int, int]], block_size: int, seed: int
) -> None:
    """With merging off, each power-of-two row-count class is its own bucket."""
    case = _make_case(layout, block_size, kv_heads=2, group=2, seed=seed)
    with mock.patch.object(paged_attention_module, "_MERGE_SLACK", 0):
        meta = build_attention_metadata(case["segments"], block_size, case["num_rows"])
        out = _run(case, block_size)
    classes = {(n - 1).bit_length() for n, _ in layout}
    assert len(meta.buckets) == len(classes)
    torch.testing.assert_close(out, _dense_reference(case), rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    num_planes=st.integers(1, 4),
    block_size=st.sampled_from([1, 4, 16]),
    position=st.integers(0, 30),
    data=st.data(),
)
def test_exit_copy(num_planes: int, block_size: int, position: int, data: st.DataObject) -> None:
    exit_plane = data.draw(st.integers(0, num_planes - 1))
    layers, kvh = 3, 2
    per_plane = position // block_size + 2
    num_blocks = per_plane * num_planes + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(position)).tolist()
    tables = [perm[i * per_plane : (i + 1) * per_plane] for i in range(num_planes)]
    shape = (layers, num_blocks, block_size, kvh, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    src, dst = exit_copy_slots(tables, position, exit_plane, block_size)
    assert len(src) == len(dst) == num_planes - 1 - exit_plane
    src_slot = slot_of(tables[exit_plane], position, block_size)
    assert all(s == src_slot for s in src)
    copy_kv_slots(
        k_cache, v_cache, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    )

    for cache, before in ((k_cache, k_before), (v_cache, v_before)):
        flat, flat_before = cache.flatten(1, 2), before.flatten(1, 2)  # [L, slots, kvh, hd]
        changed = torch.zeros(flat.shape[1], dtype=torch.bool)
        for plane in range(exit_plane + 1, num_planes):
            d = slot_of(tables[plane], position, block_size)
            changed[d] = True
            torch.testing.assert_close(flat[:, d], flat_before[:, src_slot], rtol=0, atol=0)
        torch.testing.assert_close(flat[:, ~changed], flat_before[:, ~changed], rtol=0, atol=0)


def test_exit_copy_slots_errors() -> None:
    with pytest.raises(ValueError, match="exit_plane"):
        exit_copy_slots([[0], [1]], 0, 2, 4)
    with pytest.raises(ValueError, match="does not cover position"):
        exit_copy_slots([[0], [1]], 5, 0, 4)
    with pytest.raises(ValueError, match="equal-length"):
        z = torch.zeros(2, 1, 1, 1, 1)
        copy_kv_slots(z, z, torch.tensor([0]), torch.tensor([0, 0]))


@pytest.mark.parametrize(
    ("segments", "num_rows", "match"),
    [
        ([Segment(0, 3, 0, [0]), Segment(2, 2, 0, [1])], 4, "overlap"),
        ([Segment(0, 2, 0, [0]), Segment(3, 1, 0, [1])], 4, "gap"),
        ([Segment(0, 2, 0, [0])], 3, "gap"),
        ([Segment(1, 2, 0, [0])], 3, "gap"),
        ([Segment(0, 4, 0, [0])], 3, "cover 4 rows"),
        ([Segment(0, 2, 3, [0])], 2, "block table too short"),
        ([Segment(0, 1, 0, [])], 1, "block table too short"),
        ([Segment(0, 0, 0, [0])], 0, "num_rows < 1"),
        ([Segment(0, 1, -1, [0])], 1, "negative"),
    ],
)
def test_metadata_validation(segments: list[Segment], num_rows: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(segments, block_size=4, num_rows=num_rows)


def test_paged_attention_shape_checks() -> None:
    meta = build_attention_metadata([Segment(0, 1, 0, [5])], block_size=4, num_rows=1)
    cache = torch.zeros(3, 4, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(torch.zeros(1, 1, HEAD_DIM), cache, cache, meta, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        big = torch.zeros(8, 2, 1, HEAD_DIM)
        paged_attention(torch.zeros(1, 1, HEAD_DIM), big, big, meta, 1.0)


def test_flash_attn_unavailable_on_cpu() -> None:
    assert flash_attn_available() is False
