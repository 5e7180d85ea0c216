"""Sampling: seeded, per-request, independent of batch neighbours, and equal to the oracle
driven with the same sampler; the batched Gumbel-max sampler's distribution, filters, bad
rows and counter-based noise."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.ops.sample import sample_reference
from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.sampling import (
    SamplingError,
    counter_hash,
    gumbel_noise,
    sample_batch,
    sample_token,
    uniform_from_bits,
)
from services.engine.engine import LLMEngine

PROMPT = [17, 4, 250, 31, 99]


def sampled(toy_model, params: SamplingParams, neighbours: int = 0, **config) -> FinishedEvent:
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=256, **config))
    engine.add_request("target", PROMPT, params)
    for i in range(neighbours):
        engine.add_request(
            f"n{i}",
            [3 + i, 8, 60 + i],
            SamplingParams(max_tokens=9, temperature=1.0, seed=i, min_loops=1, exit_threshold=0.5),
        )
    events = engine.run_until_done()
    return next(e for e in events if isinstance(e, FinishedEvent) and e.request_id == "target")


@pytest.mark.unit
def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch(toy_model) -> None:
    params = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=1234,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
    )
    alone = sampled(toy_model, params)
    crowded = sampled(toy_model, params, neighbours=5)
    crowded_async = sampled(
        toy_model,
        params,
        neighbours=5,
        async_scheduling=True,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=2,
    )
    assert alone.token_ids == crowded.token_ids == crowded_async.token_ids
    assert alone.exit_depths == crowded.exit_depths == crowded_async.exit_depths
    other_seed = sampled(toy_model, SamplingParams(**{**_fields(params), "seed": 99}))
    assert other_seed.token_ids != alone.token_ids


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


@pytest.mark.oracle
def test_sampled_engine_equals_the_oracle_with_the_same_sampler(toy_model, oracle) -> None:
    params = SamplingParams(
        max_tokens=12,
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        seed=7,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
    )
    got = sampled(toy_model, params, neighbours=3)
    expected = oracle.generate(
        PROMPT,
        max_tokens=12,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
        sampler=lambda logits, i: sample_token(
            logits, temperature=0.8, top_k=40, top_p=0.95, seed=7, output_index=i
        ),
    )
    assert got.token_ids == expected.token_ids
    assert got.exit_depths == expected.exit_depths


@pytest.mark.unit
def test_filters_that_leave_one_token_are_greedy() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(logits))
    for i in range(20):
        assert (
            sample_token(logits, temperature=1.0, top_k=1, top_p=1.0, seed=i, output_index=i)
            == best
        )
        assert (
            sample_token(logits, temperature=1.0, top_k=0, top_p=1e-6, seed=i, output_index=i)
            == best
        )


@pytest.mark.unit
def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits, 5).indices.tolist())
    draws = {
        sample_token(logits, temperature=2.0, top_k=5, top_p=1.0, seed=3, output_index=i)
        for i in range(200)
    }
    assert draws <= allowed and len(draws) > 1


@pytest.mark.unit
def test_greedy_and_sampled_rows_in_one_batch_each_get_their_own_token(toy_model) -> None:
    # The worker takes one batched argmax for greedy rows and the host sampler for the
    # others; a batch that interleaves both must hand every row its own token.
    def params(i: int) -> SamplingParams:
        temperature = 0.0 if i % 2 else 0.9
        return SamplingParams(
            max_tokens=8,
            temperature=temperature,
            seed=i,
            min_loops=1,
            exit_threshold=0.7,
            ignore_eos=True,
        )

    prompts = [[5 + i, 40 + 3 * i, 7, 200 - i] for i in range(6)]

    def run(ids: list[int]) -> dict[str, FinishedEvent]:
        engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=256))
        for i in ids:
            engine.add_request(f"r{i}", prompts[i], params(i))
        return {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}

    together = run(list(range(6)))
    for i in range(6):
        alone = run([i])[f"r{i}"]
        assert together[f"r{i}"].token_ids == alone.token_ids
        assert together[f"r{i}"].exit_depths == alone.exit_depths


# ------------------------------------------------------------------ the batched sampler


def _params(rows: list[dict]) -> dict[str, torch.Tensor]:
    """sample_batch's per-row tensors from one dict per row (float64 temperatures, as
    sample_token passes them)."""
    return {
        "temperature": torch.tensor([r["temperature"] for r in rows], dtype=torch.float64),
        "top_k": torch.tensor([r.get("top_k", 0) for r in rows], dtype=torch.int64),
        "top_p": torch.tensor([r.get("top_p", 1.0) for r in rows], dtype=torch.float32),
        "seed": torch.tensor([r.get("seed", 0) for r in rows], dtype=torch.int64),
        "output_index": torch.tensor([r.get("index", 0) for r in rows], dtype=torch.int64),
    }


def _sample(logits: torch.Tensor, rows: list[dict], filters: bool = True) -> tuple[list, list]:
    ids, bad = sample_batch(logits, **_params(rows), filters=filters)
    return ids.tolist(), bad.tolist()


def _uses_filters(row: dict, vocab: int) -> bool:
    return 0 < row.get("top_k", 0) < vocab or row.get("top_p", 1.0) < 1.0


def _random_row(rng: random.Random, vocab: int) -> tuple[torch.Tensor, dict]:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    logits = logits * rng.choice([0.5, 3.0, 20.0])
    kind = rng.randrange(6)
    row = {
        "temperature": 0.0 if kind == 0 else rng.choice([0.3, 0.8, 1.0, 1.7]),
        "top_k": rng.choice([0, 1, 5, 40, vocab]) if kind in (2, 4) else 0,
        "top_p": rng.choice([1e-6, 0.5, 0.9, 1.0]) if kind in (3, 4) else 1.0,
        "seed": rng.randrange(2**63),
        "index": rng.randrange(2**20),
    }
    if kind == 5 and rng.random() < 0.5:
        logits[rng.randrange(vocab)] = math.nan
    return logits, row


@pytest.mark.unit
def test_a_row_gets_the_same_token_alone_and_anywhere_in_any_batch() -> None:
    rng = random.Random(0)
    vocab = 997  # not a multiple of any vector width: rows start at every alignment
    pool = [_random_row(rng, vocab) for _ in range(64)]
    alone = [
        _sample(logits[None], [row], filters=_uses_filters(row, vocab)) for logits, row in pool
    ]
    for n in range(1, 65):
        chosen = rng.sample(range(64), n)
        logits = torch.stack([pool[i][0] for i in chosen])
        ids, bad = _sample(logits, [pool[i][1] for i in chosen])
        got = [([t], [b]) for t, b in zip(ids, bad, strict=True)]
        assert got == [alone[i] for i in chosen], f"batch of {n}"
    # the pool covers what it should: sampled, greedy, filtered and bad rows
    assert sum(b for _, (b,) in alone) >= 3 and len({t for (t,), _ in alone}) > 30


@pytest.mark.unit
def test_greedy_rows_are_the_first_argmax_of_the_raw_logits() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 4
    logits[1, 7] = logits[1, 200] = 100.0  # a tie: the first one wins
    logits[2, :] = float("-inf")  # nothing finite: still argmax, as greedy always was
    rows = [{"temperature": 0.0, "top_k": 3, "top_p": 0.1, "seed": i, "index": i} for i in range(6)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        ids, bad = _sample(logits.to(dtype), rows)
        assert ids == torch.argmax(logits.to(dtype), dim=-1).tolist() and not any(bad)
        assert ids[1] == 7


@pytest.mark.unit
def test_top_k_keeps_the_k_best_and_every_tie_with_the_kth() -> None:
    logits = torch.tensor([1.0, 5.0, 4.0, 0.5, 4.0, 4.0, -2.0, 3.9])
    rows = [{"temperature": 5.0, "top_k": 2, "seed": 11, "index": i} for i in range(2000)]
    ids, bad = _sample(logits.expand(2000, -1), rows)
    assert set(ids) == {1, 2, 4, 5} and not any(bad)
    wide = torch.randn(4096, 512, generator=torch.Generator().manual_seed(3))
    k = torch.tensor([1, 2, 7, 50] * 1024)
    rows = [{"temperature": 3.0, "top_k": int(k[i]), "seed": 1, "index": i} for i in range(4096)]
    ids, _ = _sample(wide, rows)
    rank = (wide > wide.gather(1, torch.tensor(ids)[:, None])).sum(dim=1)
    assert bool((rank < k).all())
    assert ids[::4] == torch.argmax(wide[::4], dim=-1).tolist()  # top_k 1 is greedy


@pytest.mark.unit
def test_top_p_keeps_the_smallest_prefix_that_reaches_it() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    for top_p, kept in [(1.2e-38, {0}), (0.45, {0}), (0.55, {0, 1}), (0.85, {0, 1, 2})]:
        rows = [{"temperature": 1.0, "top_p": top_p, "seed": 4, "index": i} for i in range(600)]
        ids, bad = _sample(logits.expand(600, -1), rows)
        assert set(ids) == kept and not any(bad), top_p


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """softmax(logits / T) restricted by top-k then top-p, in float64, written the plain way
    (this module's previous sampler)."""
    scaled = logits.double() / temperature
    if 0 < top_k < scaled.numel():
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(ordered, dim=-1) - ordered) >= top_p
        probs = torch.zeros_like(probs).scatter(0, order, ordered.masked_fill(drop, 0.0))
    return probs / probs.sum()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.3, 9, 0.8)]
)
def test_draws_follow_the_filtered_softmax(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    expected = _reference_probs(logits, temperature, top_k, top_p)
    n = 40_000
    rows = [{"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": 99, "index": i}
            for i in range(n)]  # fmt: skip
    ids, bad = _sample(logits.expand(n, -1), rows)
    assert not any(bad)
    counts = torch.bincount(torch.tensor(ids), minlength=12).double()
    assert bool((counts[expected == 0] == 0).all())  # no mass outside the kept set
    kept = expected > 0
    assert int(kept.sum()) >= 4
    observed, wanted = counts[kept], expected[kept] * n
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(kept.sum()) - 1
    # about 4.5 standard deviations above the chi-square's mean of dof
    assert chi2 < dof + 4.5 * math.sqrt(2 * dof), chi2
    assert 0.5 * float((counts / n - expected).abs().sum()) < 0.01


@pytest.mark.unit
def test_filters_off_gives_the_same_tokens_when_no_row_filters() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(6))
    rows = [{"temperature": [0.0, 0.5, 1.0, 2.0][i % 4], "seed": i, "index": 3 * i}
            for i in range(64)]  # fmt: skip
    assert _sample(logits, rows, filters=True) == _sample(logits, rows, filters=False)


@pytest.mark.unit
def test_rows_that_cannot_be_sampled_are_reported_and_the_others_still_sample() -> None:
    vocab = 50
    base = torch.randn(10, vocab, generator=torch.Generator().manual_seed(7)) * 3
    ok = {"temperature": 0.8, "seed": 3, "index": 5}
    cases = [
        ("sampled", ok, None, False),
        ("NaN, greedy", {"temperature": 0.0}, math.nan, True),
        ("greedy", {"temperature": 0.0}, None, False),
        ("NaN, sampled", ok, math.nan, True),
        ("temperature overflows", {**ok, "temperature": 1e-300}, None, True),
        ("top_p 0 in float32", {**ok, "top_p": 1e-46}, None, True),
        ("nothing finite", ok, -math.inf, True),
        ("an inf logit", ok, math.inf, True),
        ("negative temperature", {**ok, "temperature": -1.0}, None, True),
        ("filtered", {**ok, "top_k": 5, "top_p": 0.7}, None, False),
    ]
    logits = base.clone()
    for i, (_, _, poison, _) in enumerate(cases):
        if poison == -math.inf:
            logits[i] = -math.inf
        elif poison is not None:
            logits[i, 3] = poison
    ids, bad = _sample(logits, [row for _, row, _, _ in cases])
    for i, (name, row, _, is_bad) in enumerate(cases):
        assert bad[i] == is_bad, name
        if is_bad:
            assert ids[i] == 0, name
            with pytest.raises(SamplingError):
                sample_token(
                    logits[i],
                    temperature=row["temperature"],
                    top_k=row.get("top_k", 0),
                    top_p=row.get("top_p", 1.0),
                    seed=row.get("seed", 0),
                    output_index=row.get("index", 0),
                )
        else:
            assert ids[i] == _sample(logits[i : i + 1], [row])[0][0], name
    # float32 temperatures cannot tell 1e-300 from greedy: that row is then greedy
    float32 = _params([{**ok, "temperature": 1e-300}])
    float32["temperature"] = float32["temperature"].float()
    ids32, bad32 = sample_batch(base[4:5], **float32)
    assert ids32.tolist() == [int(torch.argmax(base[4]))] and not bool(bad32[0])


@pytest.mark.unit
def test_sample_token_is_sample_batch_on_one_row() -> None:
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(8)) * 2
    rows = [{"temperature": 0.9, "top_k": [0, 20][i % 2], "top_p": [1.0, 0.9][i // 4],
             "seed": 1000 + i, "index": 7 * i} for i in range(8)]  # fmt: skip
    ids, _ = _sample(logits, rows)
    assert ids == [
        sample_token(logits[i], temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
                     seed=r["seed"], output_index=r["index"])
        for i, r in enumerate(rows)
    ]  # fmt: skip


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.unit
def test_sample_batch_never_synchronises_with_the_host() -> None:
    logits = torch.randn(16, 128, generator=torch.Generator().manual_seed(9))
    logits[3, 5] = math.nan
    rows = [{"temperature": [0.0, 1.0][i % 2], "top_k": i % 5, "top_p": 0.5 + i / 40,
             "seed": i, "index": i} for i in range(16)]  # fmt: skip
    params = _params(rows)
    for filters in (True, False):
        with _RecordOps() as mode:  # the CPU op's body: the op itself is one dispatch
            sample_reference(logits, *params.values(), filters)
        assert {"argmax", "bitwise_xor", "log"} <= mode.ops  # the mode saw the work
        synchronising = {"_local_scalar_dense", "item", "nonzero", "nonzero_static"}
        assert not mode.ops & synchronising | {o for o in mode.ops if "masked_select" in o}


# ------------------------------------------------------------------ counter-based noise

M32 = 0xFFFFFFFF


def _mix32_reference(x: int) -> int:
    """lowbias32 on Python ints, as its author writes it for uint32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _hash_reference(seed: int, index: int, vocab_id: int) -> int:
    key = _mix32_reference((seed & M32) ^ 0x243F6A88)
    key = _mix32_reference(key ^ (seed >> 32))
    key = _mix32_reference(key ^ (index & M32))
    key = _mix32_reference(key ^ (index >> 32))
    return _mix32_reference(_mix32_reference(vocab_id ^ 0x85A308D3) ^ key)


@pytest.mark.unit
def test_the_hash_is_uint32_lowbias32_whatever_the_int64_wraparound() -> None:
    # pinned: a change here changes every seeded request's tokens
    pairs = [(0, 0), (1, 0), (0, 1), (2**63 - 1, 2**40 + 3), (123456789, 4095), (2**32, 2**32)]
    seeds = torch.tensor([s for s, _ in pairs])
    indices = torch.tensor([i for _, i in pairs])
    got = counter_hash(seeds, indices, 70).tolist()
    for (seed, index), row in zip(pairs, got, strict=True):
        assert row == [_hash_reference(seed, index, v) for v in range(70)]
    assert min(min(r) for r in got) >= 0 and max(max(r) for r in got) <= M32


@pytest.mark.unit
def test_the_noise_depends_only_on_seed_index_and_vocab_id() -> None:
    seeds = torch.tensor([5, 5, 6, 2**62])
    indices = torch.tensor([0, 1, 0, 9])
    full = counter_hash(seeds, indices, 1000)
    assert torch.equal(counter_hash(seeds, indices, 300), full[:, :300])  # any vocab shard
    for i in range(4):  # any row, any batch size
        assert torch.equal(
            counter_hash(seeds[i : i + 1], indices[i : i + 1], 1000), full[i : i + 1]
        )
    assert torch.equal(counter_hash(seeds.flip(0), indices.flip(0), 1000), full.flip(0))


@pytest.mark.unit
def test_the_hash_gives_distinct_well_spread_open_uniforms() -> None:
    seeds = torch.arange(16).repeat_interleave(64)  # 16 seeds x 64 indices x 1024 ids
    indices = torch.arange(64).repeat(16)
    bits = counter_hash(seeds, indices, 1024)  # [1024, 1024]
    # one request's draws: distinct across vocab ids in a draw and across its indices per id
    assert all(len(set(row)) == 1024 for row in bits.tolist())
    per_request = bits.view(16, 64, 1024)
    assert bool((per_request.sort(dim=1).values.diff(dim=1) != 0).all())
    # across everything, collisions only as often as random 32-bit values would collide
    n = bits.numel()
    expected = n * (n - 1) / 2 / 2**32
    assert abs((n - bits.unique().numel()) - expected) < 5 * math.sqrt(expected)
    # every bit fair, and no correlation between neighbouring ids, indices or seeds
    flat = bits.flatten()
    ones = [int(((flat >> b) & 1).sum()) / n for b in range(32)]
    assert all(abs(share - 0.5) < 0.003 for share in ones)
    u = uniform_from_bits(bits).double()
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=256, min=0.0, max=1.0)
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + 4.5 * math.sqrt(2 * 255)
    grid = u.view(16, 64, 1024) - 0.5
    for a, b in [
        (grid[:, :, 1:], grid[:, :, :-1]),
        (grid[:, 1:], grid[:, :-1]),
        (grid[1:], grid[:-1]),
    ]:
        assert abs(float((a * b).mean()) / (1 / 12)) < 0.01


@pytest.mark.unit
def test_flipping_any_seed_or_index_bit_changes_half_the_hash_bits() -> None:
    n = 512
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(10))
    indices = torch.randint(0, 2**20, (n,), generator=torch.Generator().manual_seed(11))
    base = counter_hash(seeds, indices, 8)
    for which, bit in [("seed", b) for b in range(63)] + [("index", b) for b in range(40)]:
        s = seeds ^ (1 << bit) if which == "seed" else seeds
        i = indices ^ (1 << bit) if which == "index" else indices
        flipped = base ^ counter_hash(s, i, 8)
        changed = sum(int(((flipped >> b) & 1).sum()) for b in range(32)) / (32 * flipped.numel())
        assert abs(changed - 0.5) < 0.02, (which, bit)


@pytest.mark.unit
def test_uniforms_never_reach_0_or_1_and_the_noise_is_finite() -> None:
    extremes = uniform_from_bits(torch.tensor([0, 1, 511, 512, M32 - 511, M32]))
    assert extremes.tolist() == [2.0**-24, 2.0**-24, 2.0**-24, 3 * 2.0**-24] + [1 - 2.0**-24] * 2
    noise = -torch.log(-torch.log(extremes))
    assert bool(torch.isfinite(noise).all())
    g = gumbel_noise(torch.arange(64), torch.arange(64), 4096).double()
    # a standard Gumbel's mean is the Euler-Mascheroni constant and its variance pi^2 / 6
    assert abs(float(g.mean()) - 0.5772) < 0.01
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.03


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_tokens_are_batch_invariant_the_noise_bits_match_and_nothing_syncs() -> None:
    rng = random.Random(12)
    vocab = 151_936
    pool = [_random_row(rng, vocab) for _ in range(24)]
    logits = torch.stack([row_logits for row_logits, _ in pool]).cuda()
    params = {k: v.cuda() for k, v in _params([row for _, row in pool]).items()}
    torch.cuda.set_sync_debug_mode("error")
    try:
        batched = sample_batch(logits, **params)
        alone = [
            sample_batch(logits[i : i + 1], **{k: v[i : i + 1] for k, v in params.items()})
            for i in range(24)
        ]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids, bad = batched
    assert ids.tolist() == [int(a[0]) for a, _ in alone]
    assert bad.tolist() == [bool(b[0]) for _, b in alone]
    seeds, indices = params["seed"], params["output_index"]
    assert torch.equal(
        counter_hash(seeds, indices, vocab).cpu(), counter_hash(seeds.cpu(), indices.cpu(), vocab)
    )
