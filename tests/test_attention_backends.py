"""Attention backends (CPU): SDPA and flash index math equal the reference paged attention;
start-up selection; the engine gives the same greedy tokens whichever backend runs."""

from __future__ import annotations

import importlib
import math
import random
from unittest import mock

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import (
    AttentionMetadata,
    FlashBackend,
    ReferenceBackend,
    SdpaBackend,
    Segment,
    build_attention_metadata,
    paged_attention,
    select_attention_backend,
    write_kv,
)
from kernels.flash import _parse_version, build_flash_state, flash_paged_block_multiple
from kernels.sdpa_attention import build_sdpa_state, sdpa_paged_attention

pytestmark = pytest.mark.unit

HEAD_DIM = 8
# The module itself: the package attribute of this name is the re-exported function.
paged_attention_module = importlib.import_module("kernels.paged_attention")
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def _sdpa_float64_ok() -> bool:
    try:
        x = torch.zeros(1, 1, 2, HEAD_DIM, dtype=torch.float64)
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
    except Exception:
        return False
    return True


DTYPES = [torch.float32] + ([torch.float64] if _sdpa_float64_ok() else [])
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


def make_case(
    layout: list[tuple[int, int]],
    block_size: int,
    kv_heads: int,
    group: int,
    seed: int,
    dtype: torch.dtype,
) -> tuple[list[Segment], int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random pass: shuffled, non-contiguous block tables; history written; unused cache NaN
    (any read of unwritten memory, e.g. through padding, poisons the output)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(p + n) // block_size) + rng.randint(0, 2) for n, p in layout]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    segments: list[Segment] = []
    row = 0
    for (n, p), nb in zip(layout, need, strict=True):
        table, perm = perm[:nb], perm[nb:]
        segments.append(Segment(row_start=row, num_rows=n, pos_start=p, block_table=table))
        row += n
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for seg in segments:
        for pos in range(seg.pos_start):
            blk, off = seg.block_table[pos // block_size], pos % block_size
            k_cache[blk, off] = torch.randn(kv_heads, HEAD_DIM, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(kv_heads, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(row, kv_heads * group, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(row, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(row, kv_heads, HEAD_DIM, generator=gen).to(dtype)
    rng.shuffle(segments)  # segment order must not matter
    meta = build_attention_metadata(segments, block_size, row)
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    return segments, row, q, k_cache, v_cache, meta


def fake_flash_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> torch.Tensor:
    """flash_attn_with_kvcache's documented paged semantics, written out plainly: batch b reads
    positions < cache_seqlens[b] through block_table[b]; query i of Sq sees keys up to
    cache_seqlens[b] - Sq + i (bottom-right causal); a row seeing no key outputs 0."""
    assert causal and q.is_contiguous() and q.dim() == 4
    assert cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
    batch, sq, heads, _ = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(batch):
        length = int(cache_seqlens[b])
        pos = torch.arange(length)
        blocks = block_table[b].long()[pos // bs]
        keys = k_cache[blocks, pos % bs].double().repeat_interleave(heads // kvh, dim=1)
        vals = v_cache[blocks, pos % bs].double().repeat_interleave(heads // kvh, dim=1)
        for i in range(sq):
            last = length - sq + i
            if last < 0:
                continue
            scores = torch.einsum("hd,khd->hk", q[b, i].double(), keys[: last + 1])
            probs = torch.softmax(scores * softmax_scale, dim=-1)
            out[b, i] = torch.einsum("hk,khd->hd", probs, vals[: last + 1]).to(q.dtype)
    return out


layouts = st.lists(
    st.tuples(st.one_of(st.just(1), st.integers(1, 7)), st.integers(0, 40)),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=30, deadline=None)
@given(
    layout=layouts,
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_sdpa_matches_reference(
    dtype: torch.dtype, layout: list[tuple[int, int]], block_size: int, group: int, seed: int
) -> None:
    _, _, q, kc, vc, meta = make_case(layout, block_size, 2, group, seed, dtype)
    ref = paged_attention(q, kc, vc, meta, SCALE)
    out = SdpaBackend().forward(q, kc, vc, meta, SCALE)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("group", [1, 2])
def test_sdpa_causal_fast_path(group: int) -> None:
    # Same-length whole prompts from position 0: SDPA's is_causal replaces the mask.
    _, _, q, kc, vc, meta = make_case([(5, 0), (5, 0), (5, 0)], 4, 2, group, 3, torch.float32)
    state = build_sdpa_state(meta)
    assert state.is_causal and state.attn_mask is None
    torch.testing.assert_close(
        sdpa_paged_attention(q, kc, vc, meta, SCALE, state),
        paged_attention(q, kc, vc, meta, SCALE),
        rtol=2e-5,
        atol=2e-5,
    )
    # One row short of the full grid (or any history) keeps the explicit mask.
    for layout in ([(5, 0), (4, 0)], [(5, 0), (4, 1)], [(3, 2)]):
        _, _, _, _, _, meta = make_case(layout, 4, 2, group, 3, torch.float32)
        assert not build_sdpa_state(meta).is_causal


def test_sdpa_bf16_close_to_reference() -> None:
    _, _, q, kc, vc, meta = make_case([(1, 9), (5, 3), (1, 0), (3, 17)], 4, 2, 2, 7, torch.bfloat16)
    out = SdpaBackend().forward(q, kc, vc, meta, SCALE)
    assert out.dtype == torch.bfloat16
    ref = paged_attention(q.float(), kc.float(), vc.float(), meta, SCALE)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@settings(max_examples=20, deadline=None)
@given(
    layout=layouts,
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_flash_index_math_matches_reference(
    layout: list[tuple[int, int]], block_size: int, group: int, seed: int
) -> None:
    """The flash backend's left padding, block_table and cache_seqlens, driven through a
    plain-torch stand-in of flash_attn_with_kvcache, reproduce the reference on CPU."""
    _, _, q, kc, vc, meta = make_case(layout, block_size, 2, group, seed, torch.float64)
    backend = FlashBackend(kernel=fake_flash_with_kvcache)
    out = backend.forward(q, kc, vc, meta, SCALE)
    torch.testing.assert_close(out, paged_attention(q, kc, vc, meta, SCALE), rtol=1e-10, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(
    layout=layouts,
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_backends_per_bucket_match_unbucketed(
    layout: list[tuple[int, int]], block_size: int, group: int, seed: int
) -> None:
    """Every backend gives the unbucketed reference's result when each row-count class runs
    as its own bucket (merging off), so mixed passes take the multi-bucket paths."""
    with mock.patch.object(paged_attention_module, "_MERGE_SLACK", 0):
        segments, rows, q, kc, vc, meta = make_case(
            layout, block_size, 2, group, seed, torch.float64
        )
    flat = build_attention_metadata(segments, block_size, rows, bucketed=False)
    assert len(meta.buckets) == len({(n - 1).bit_length() for n, _ in layout})
    ref = paged_attention(q, kc, vc, flat, SCALE)
    backends = [ReferenceBackend(), FlashBackend(kernel=fake_flash_with_kvcache)]
    if torch.float64 in DTYPES:
        backends.append(SdpaBackend())
    for backend in backends:
        out = backend.forward(q, kc, vc, meta, SCALE)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, msg=backend.name)


def test_flash_state_shapes() -> None:
    _, rows, _, _, _, meta = make_case([(1, 9), (5, 3), (2, 0)], 4, 2, 1, 0, torch.float32)
    state = build_flash_state(meta)
    assert state.block_table.dtype == torch.int32 and state.cache_seqlens.dtype == torch.int32
    assert state.block_table.shape == (3, math.ceil(10 / 4))
    assert sorted(state.cache_seqlens.tolist()) == [2, 8, 10]
    assert state.q_index.shape == (rows,) and len(set(state.q_index.tolist())) == rows


def test_empty_pass() -> None:
    meta = build_attention_metadata([], 4, 0)
    kc = torch.zeros(2, 4, 2, HEAD_DIM)
    q = torch.zeros(0, 2, HEAD_DIM)
    for backend in (
        ReferenceBackend(),
        SdpaBackend(),
        FlashBackend(kernel=fake_flash_with_kvcache),
    ):
        assert backend.forward(q, kc, kc, meta, SCALE).shape == (0, 2, HEAD_DIM)


def test_prepare_once_per_pass() -> None:
    _, _, q, kc, vc, meta = make_case([(1, 5), (3, 0)], 4, 2, 1, 1, torch.float32)
    backend = SdpaBackend()
    backend.prepare(meta)
    state = backend._state
    backend.forward(q, kc, vc, meta, SCALE)
    assert backend._state is state  # layers reuse the pass state
    _, _, q2, kc2, vc2, meta2 = make_case([(2, 1)], 4, 2, 1, 2, torch.float32)
    torch.testing.assert_close(
        backend.forward(q2, kc2, vc2, meta2, SCALE), paged_attention(q2, kc2, vc2, meta2, SCALE)
    )
    assert backend._state is not state  # a new pass is prepared lazily


# ------------------------------------------------------------------ selection


def test_cpu_default_is_reference() -> None:
    with structlog.testing.capture_logs() as logs:
        backend = select_attention_backend(torch.device("cpu"), torch.float32, 16, 64)
    assert isinstance(backend, ReferenceBackend)
    assert [e["backend"] for e in logs if e.get("event") == "attention_backend"] == ["reference"]
    assert "cpu" in logs[-1]["reason"]
    assert isinstance(
        select_attention_backend("cpu", torch.float32, 16, 64, "auto"), ReferenceBackend
    )


def test_prefer_is_honoured() -> None:
    assert isinstance(select_attention_backend("cpu", torch.float32, 4, 8, "sdpa"), SdpaBackend)
    assert isinstance(
        select_attention_backend("cpu", torch.bfloat16, 4, 8, "reference"), ReferenceBackend
    )
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("cpu", torch.float32, 4, 8, "xformers")


def test_flash_without_cuda_falls_back_with_reason() -> None:
    with structlog.testing.capture_logs() as logs:
        backend = select_attention_backend("cpu", torch.bfloat16, 256, 128, prefer="flash")
    assert isinstance(backend, ReferenceBackend)
    assert "flash requested but unusable" in backend.reason and "CUDA" in backend.reason
    assert logs[-1]["reason"] == backend.reason and logs[-1]["requested"] == "flash"


def test_flash_version_rule() -> None:
    assert _parse_version("2.7.4.post1") == (2, 7, 4)
    assert _parse_version("2.6.0rc1") == (2, 6, 0)
    assert _parse_version("") == ()
    assert flash_paged_block_multiple((2, 5, 0)) == 256
    assert flash_paged_block_multiple((2, 8, 3)) == 256
    assert flash_paged_block_multiple((2, 4, 2)) is None  # no paged KV before 2.5
    assert flash_paged_block_multiple((3, 0, 0)) is None  # unverified API: fall back
    assert flash_paged_block_multiple(None) is None
