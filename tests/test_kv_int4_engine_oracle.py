"""The engine under ``--kv-cache-dtype int4-delta`` equals the serial oracle applying its own
int4-delta codec (services/oracle/kv_codec.py), token for token and depth for depth, over
the randomized workloads of tests/test_engine_oracle.py: every prefill mode (chunks that
complete blocks mid-pass), prefix hits on sealed blocks, preemption (tight KV), async
scheduling, early exits and token-sparse prefill's frozen tokens (tokens that store no
delta above their exit or freeze loop)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, KVLayout, SchedulerConfig
from services.engine.engine import LLMEngine
from services.scheduler.core.intake import KnownOutputs
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import D, max_kv_blocks, workloads

pytestmark = pytest.mark.oracle


@st.composite
def configs(draw: st.DrawFn, arrivals: list[Arrival]) -> SchedulerConfig:
    """The last-exited layout (int4-delta's only one) under every prefill mode, tight KV
    (preemption), prefix caching, async scheduling and token-sparse prefill where split
    prefill allows it; blocks of 2 to 8 tokens, so prompts span several sealed blocks."""
    mode = draw(st.sampled_from(["atomic", "split", "wcpb"]))
    block_size = draw(st.sampled_from([2, 4, 8]))
    need = max_kv_blocks(arrivals, block_size)
    tight = draw(st.booleans())
    return SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        prefill_chunk_size=draw(st.integers(1, 8)),
        split_prefill=mode != "atomic",
        wavefront_chunked_prefill=mode == "wcpb",
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)) if tight else need * len(arrivals) + 8,
        kv_layout=KVLayout.LAST_EXITED,
        kv_cache_dtype="int4-delta",
        # 0: plane 0 the only anchor; 1: every plane coded on its own; 2, 3: chains that
        # restart above plane 0, so exited and frozen tokens cross an anchor
        kv_int4_anchor_every=draw(st.sampled_from([0, 1, 2, 3, D])),
        refill=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        token_sparse_prefill=mode != "atomic" and draw(st.booleans()),
    )


def test_int4_engine_equals_int4_oracle(toy_model, oracle) -> None:
    compared: list[int] = []  # tokens compared per request
    produced: list[int] = []  # tokens the oracle generated per request
    sealed: list[int] = []  # blocks sealed (coded) at the end of each run
    skipped: list[int] = []  # tokens a sealed block stores no delta for (exits, freezes)
    hits: list[int] = []  # prompt tokens the prefix cache held (read from sealed blocks)
    preemptions: list[int] = []
    frozen: list[int] = []  # prompt token-loops token-sparse prefill did not run
    by_anchor: dict[int, int] = {}  # tokens compared per anchor interval

    @settings(
        # fixed examples: a KV code one float32 rounding from its boundary may flip between
        # engine and oracle (docs/kv_codecs.md, "What is exact"), so CI draws no new ones
        derandomize=True,
        max_examples=20,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        arrivals = data.draw(workloads())
        config = data.draw(configs(arrivals))
        record = run_workload(toy_model, config, arrivals)
        assert record.engine is not None
        runner = record.engine.runner
        assert runner.k_cache.dtype == torch.uint8  # codes, not values
        store = runner.int4.store
        sealed.append(int(store.sealed.sum()))
        skipped.append(int((store.stored[0][torch.from_numpy(store.sealed)] == 0).sum()))
        assert set(record.finished) == {a.request_id for a in arrivals}
        preemptions.append(record.engine.scheduler.stats.num_preemptions)
        frozen.append(record.engine.scheduler.stats.num_prefill_rows_saved)
        for a in arrivals:
            finished = record.finished[a.request_id]
            hits.append(finished.num_cached_tokens)
            expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
            compared.append(assert_matches_oracle(finished, expected, f"{a.request_id} {config}"))
            produced.append(len(expected.token_ids))
            every = config.kv_int4_anchor_every
            by_anchor[every] = by_anchor.get(every, 0) + compared[-1]

    check()
    print(
        f"int4-delta engine == oracle: {sum(compared)} of {sum(produced)} tokens compared, "
        f"{sum(sealed)} blocks sealed, {sum(skipped)} exited or frozen tokens without a "
        f"delta, {sum(hits)} prompt tokens from the prefix cache, {sum(preemptions)} "
        f"preemptions, {sum(frozen)} token-loops frozen by sparse prefill; tokens compared "
        f"per anchor interval {dict(sorted(by_anchor.items()))}"
    )
    assert sum(compared) > 0
    assert sum(by_anchor.get(every, 0) for every in (1, 2, 3)) > 0  # chains past plane 0
    assert sum(sealed) > 0 and sum(skipped) > 0  # the runs read codes, exits included
    assert sum(compared) >= 0.8 * sum(produced), (sum(compared), sum(produced))


def _compare(toy_model, oracle, config: SchedulerConfig, arrivals: list[Arrival]):
    record = run_workload(toy_model, config, arrivals)
    compared = 0
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(record.finished[a.request_id], expected, a.request_id)
    return record, compared


def _arrivals(
    shared: list[int], count: int, spacing: int, exit_threshold: float = 0.7
) -> list[Arrival]:
    params = SamplingParams(
        max_tokens=7, temperature=0.0, min_loops=1, exit_threshold=exit_threshold, ignore_eos=True
    )
    return [
        Arrival(
            f"r{i}",
            shared + [(37 * i + 11 * j) % 499 + 1 for j in range(3 + i)],
            params,
            i * spacing,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("mode", ["atomic", "wcpb"])
def test_int4_prefix_hits_read_sealed_blocks_exactly(toy_model, oracle, mode: str) -> None:
    """Later requests hit the first one's sealed prompt blocks (chunks of 3 over blocks of
    4: chunk ends inside blocks) and still equal the oracle."""
    shared = [(13 * j) % 499 + 1 for j in range(17)]
    arrivals = _arrivals(shared, 3, 12)
    config = SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=8,
        prefill_chunk_size=3,
        split_prefill=mode != "atomic",
        wavefront_chunked_prefill=mode == "wcpb",
        block_size=4,
        num_blocks=200,
        kv_cache_dtype="int4-delta",
        enable_prefix_caching=True,
    )
    record, compared = _compare(toy_model, oracle, config, arrivals)
    hits = [record.finished[a.request_id].num_cached_tokens for a in arrivals]
    assert hits[0] == 0 and all(h == 16 for h in hits[1:]), hits
    assert compared == 7 * len(arrivals)


def test_int4_preemption_recomputes_exactly(toy_model, oracle) -> None:
    """A KV pool that holds one request at a time: the others are preempted and recomputed
    on blocks that held another request's codes (opened again when written)."""
    arrivals = _arrivals([5, 9, 2, 7, 3], 3, 0)
    need = max_kv_blocks(arrivals, 2)
    config = SchedulerConfig(
        max_num_seqs=3,
        max_num_batched_tokens=16,
        prefill_chunk_size=4,
        block_size=2,
        num_blocks=need + 4,
        kv_cache_dtype="int4-delta",
        kv_admission=KVAdmission.INCREMENTAL,
    )
    record, compared = _compare(toy_model, oracle, config, arrivals)
    assert record.engine is not None
    assert record.engine.scheduler.stats.num_preemptions > 0
    assert compared == 7 * len(arrivals)


def test_int4_token_sparse_prefill_freezes_without_a_delta(toy_model, oracle) -> None:
    """Windows of 6 over blocks of 4 keep half their tokens at loops 2 and 3: the frozen
    ones are copied up from the plane below's tails and sealed with stored = 0 (no token
    exits early here: every such flag is a freeze)."""
    arrivals = _arrivals([(17 * j) % 499 + 1 for j in range(14)], 2, 3, exit_threshold=1.0)
    config = SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=12,
        prefill_chunk_size=6,
        split_prefill=True,
        block_size=4,
        num_blocks=200,
        kv_cache_dtype="int4-delta",
        token_sparse_prefill=True,
        sparse_window=6,
        prefill_retention=(1.0, 1.0, 0.5, 0.5),
    )
    record, compared = _compare(toy_model, oracle, config, arrivals)
    assert record.engine is not None
    assert record.engine.scheduler.stats.num_prefill_rows_saved > 0
    store = record.engine.runner.int4.store
    assert int((store.stored[0][torch.from_numpy(store.sealed)] == 0).sum()) > 0
    assert compared == 7 * len(arrivals)


def test_int4_a_pass_that_fails_while_sealing_leaves_its_blocks_open(
    toy_model, oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass fails in its second layer, after the first layer sealed its blocks: the host
    does not count them sealed (their tails stay), and a later request over the same prompt
    equals the oracle."""
    from messages.api import ErrorEvent, FinishedEvent
    from services.engine.engine import LLMEngine
    from services.worker.kv_int4.paged import Int4PassAttention

    real = Int4PassAttention.layer
    failed: list[list[int]] = []

    def layer(self: Int4PassAttention, idx: int, *args):  # type: ignore[no-untyped-def]
        if idx == 1 and len(self.seal) and not failed:
            failed.append(list(self.seal.block_ids))
            raise RuntimeError("injected failure while sealing")
        return real(self, idx, *args)

    monkeypatch.setattr(Int4PassAttention, "layer", layer)
    config = SchedulerConfig(
        block_size=4, num_blocks=64, kv_cache_dtype="int4-delta", split_prefill=False
    )
    engine = LLMEngine(toy_model, config)
    prompt = [5, 9, 33, 71, 2, 18, 44, 90, 7, 120, 64, 3, 8]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, min_loops=1)
    engine.add_request("a", prompt, params)
    ended: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, FinishedEvent | ErrorEvent):
                ended[event.request_id] = event
        if failed and "checked" not in ended:
            assert not engine.runner.int4.store.sealed[failed[0]].any()
            ended["checked"] = True
    assert failed and isinstance(ended["a"], ErrorEvent)
    engine.add_request("b", prompt, params)
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                ended[event.request_id] = event
    b = ended["b"]
    assert isinstance(b, FinishedEvent)
    assert (
        assert_matches_oracle(b, oracle_result(oracle, prompt, params.resolve(D, 512), config)) == 5
    )


@pytest.mark.parametrize("every", [1, 2])
def test_int4_anchor_codes_frozen_and_exited_tokens_on_its_own(
    toy_model, oracle, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """Token-sparse prefill freezes tokens at loops 2 and 3 and decode tokens exit early:
    with anchors every 1 or 2 planes, plane 2 is an anchor above their top, so it stores
    them (their copied-up K/V coded on its own) while plane 3 (every=2) stores no delta for
    them; the engine still equals the oracle."""
    from services.worker.kv_int4.store import SealBatch

    real = SealBatch.__init__
    seals: list[tuple[int, int]] = []  # (plane, tokens the sealed block stores no delta for)

    def spy(self: SealBatch, entries, *args) -> None:  # type: ignore[no-untyped-def]
        real(self, entries, *args)
        seals.extend((e[0], int((e[4] == 0).sum())) for e in self.entries)

    monkeypatch.setattr(SealBatch, "__init__", spy)
    arrivals = _arrivals([(17 * j) % 499 + 1 for j in range(14)], 2, 3, exit_threshold=0.6)
    config = SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=12,
        prefill_chunk_size=6,
        split_prefill=True,
        block_size=4,
        num_blocks=200,
        kv_cache_dtype="int4-delta",
        kv_int4_anchor_every=every,
        token_sparse_prefill=True,
        sparse_window=6,
        prefill_retention=(1.0, 1.0, 0.5, 0.5),
    )
    record, compared = _compare(toy_model, oracle, config, arrivals)
    assert record.engine is not None
    assert record.engine.scheduler.stats.num_prefill_rows_saved > 0
    at_anchor = [n for plane, n in seals if plane % every == 0]
    between = [n for plane, n in seals if plane % every]
    assert at_anchor and sum(at_anchor) == 0  # an anchor stores every token
    assert (sum(between) > 0) == (every == 2)  # plane 3 skips the frozen and exited
    assert compared == 7 * len(arrivals)


@pytest.mark.parametrize(
    ("prompts", "last_tokens", "batched", "num_blocks"),
    [
        ([[1], [1], [1] * 11], 1, 3, 24),
        ([[1], [1], [1], [1, 1, 1, 2, 14, 1]], 1, 2, 56),
        ([[1], [1], [1], [1] * 6], 2, 2, 72),
    ],
)
def test_int4_sparse_fragment_reads_and_seals_up_to_its_last_position(
    toy_model,
    oracle,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]],
    last_tokens: int,
    batched: int,
    num_blocks: int,
) -> None:
    """A token-sparse fragment runs as ONE pass row of non-adjacent positions (the last
    prompt's loop 2 runs e.g. positions 2, 3 and 10 of 11): its queries read, and its pass
    seals, the blocks up to its last position, and after the batch its planes are final up
    to there, not up to its first position plus its count (with blocks of 2 and plane 0
    the only anchor, a block left unsealed below the last position is read as stale
    codes, or is missing its tail when a later pass seals it)."""
    from services.worker.kv_int4.paged import Int4KV

    real = Int4KV.pass_attention
    gaps: list[list[int]] = []  # positions of pass rows that skip positions

    def spy(self: Int4KV, plan, requests):  # type: ignore[no-untyped-def]
        for live in plan.rows:
            at = live.positions
            if at is not None and int(at[-1]) - int(at[0]) + 1 > at.size:
                gaps.append(at.tolist())
        return real(self, plan, requests)

    monkeypatch.setattr(Int4KV, "pass_attention", spy)
    params = [
        SamplingParams(
            max_tokens=last_tokens if i == len(prompts) - 1 else 1,
            temperature=0.0,
            min_loops=1,
            max_loops=1,
            exit_threshold=1.0,
        )
        for i in range(len(prompts))
    ]
    arrivals = [Arrival(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    config = SchedulerConfig(
        max_num_seqs=1,
        max_num_batched_tokens=batched,
        prefill_chunk_size=1,
        split_prefill=True,
        block_size=2,
        num_blocks=num_blocks,
        kv_layout=KVLayout.LAST_EXITED,
        kv_cache_dtype="int4-delta",
        kv_int4_anchor_every=0,
        refill=False,
        token_sparse_prefill=True,
        enable_prefix_caching=False,
        async_scheduling=False,
    )
    record, compared = _compare(toy_model, oracle, config, arrivals)
    assert gaps, "no fragment row skipped a position: the case this test is for did not occur"
    assert record.engine is not None
    assert record.engine.scheduler.stats.num_prefill_rows_saved > 0
    assert compared == len(prompts) - 1 + last_tokens


@pytest.mark.parametrize("known", [1, 6])
def test_a_request_resumed_on_another_int4_shard_equals_the_int4_oracle(
    toy_model, oracle, known: int
) -> None:
    """A shard lost mid-generation: the request resumes on another int4-delta shard with
    the outputs already streamed (``KnownOutputs``), prefilling prompt and known tokens into
    blocks it seals itself. The whole run equals the int4 oracle and an uninterrupted
    shard, tokens and exit depths; only the rest is streamed again."""
    config = SchedulerConfig(
        block_size=4, num_blocks=64, max_num_batched_tokens=8, prefill_chunk_size=4,
        enable_prefix_caching=True, kv_cache_dtype="int4-delta",
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, min_loops=1, exit_threshold=0.6
    )
    prompt = [89, 60, 174, 57, 195, 118, 75, 6]
    whole = LLMEngine(toy_model, config)
    whole.core.add_request("r", prompt, params)
    (final,) = [e for e in whole.run_until_done() if isinstance(e, FinishedEvent)]
    expected = oracle_result(oracle, prompt, params.resolve(D, 512), config)
    assert assert_matches_oracle(final, expected, "uninterrupted") == 12
    auto = oracle_result(
        oracle, prompt, params.resolve(D, 512), replace(config, kv_cache_dtype="auto")
    )
    assert (auto.token_ids, auto.exit_depths) != (expected.token_ids, expected.exit_depths)

    resumed = LLMEngine(toy_model, config)
    known_outputs = KnownOutputs(final.token_ids[:known], final.exit_depths[:known])
    assert resumed.core.add_request("r", prompt, params, known_outputs=known_outputs) == []
    events = resumed.run_until_done()
    rest = [e for e in events if isinstance(e, TokenEvent)]
    (end,) = [e for e in events if isinstance(e, FinishedEvent)]
    assert [e.index for e in rest] == list(range(known, 12))
    assert (end.token_ids, end.exit_depths) == (final.token_ids, final.exit_depths)
    assert resumed.scheduler.kv.num_free_blocks == config.num_blocks
