"""Self-speculative decoding changes nothing a greedy request receives: tokens and exit
depths equal plain decoding's serial oracle over draft lengths, draft depths, exit
thresholds, budgets, async scheduling, tight KV (preemption), stops and aborts, and the
padded static decode path (docs/speculative.md)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.sampling import SamplingParams
from services.common.config import KVAdmission, SchedulerConfig
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import D, max_kv_blocks, workloads

pytestmark = pytest.mark.oracle


def _with(params: SamplingParams, **changes: object) -> SamplingParams:
    fields = {f: getattr(params, f) for f in params.__struct_fields__}
    return SamplingParams(**{**fields, **changes})


@st.composite
def spec_configs(draw: st.DrawFn, arrivals: list[Arrival]) -> SchedulerConfig:
    mode = draw(st.sampled_from(["atomic", "split", "wcpb"]))
    block_size = draw(st.sampled_from([1, 2, 4]))
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
        async_scheduling=draw(st.booleans()),
        max_inflight_batches=draw(st.integers(2, 3)),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        enable_prefix_caching=draw(st.booleans()),
        speculative_tokens=draw(st.sampled_from([1, 2, 3, 4, 8])),
        speculative_auto=draw(st.booleans()),
        draft_loops=draw(st.integers(1, D - 1)),
    )


def _run_and_compare(toy_model, oracle, arrivals, config, aborts=None) -> tuple[int, int]:
    """(tokens compared with the oracle, SPECULATIVE rows run)."""
    record = run_workload(toy_model, config, arrivals, aborts=aborts)  # KV reclaimed: checked
    assert set(record.finished) == {a.request_id for a in arrivals}
    compared = 0
    for a in arrivals:
        finished = record.finished[a.request_id]
        if finished.finish_reason == "abort":
            assert aborts and a.request_id in aborts
            continue
        streamed = record.tokens.get(a.request_id, [])
        assert [t.index for t in streamed] == list(range(len(finished.token_ids)))
        assert [t.token_id for t in streamed] == finished.token_ids
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(finished, expected, f"{a.request_id} {config}")
    assert record.engine is not None
    return compared, record.engine.scheduler.spec_stats.num_spec_rows


SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(data=st.data())
def test_speculative_greedy_equals_oracle(toy_model, oracle, data) -> None:
    arrivals = data.draw(workloads())
    for a in arrivals:  # some requests opt out; the others speculate beside them
        if data.draw(st.integers(0, 4)) == 0:
            a.params = _with(a.params, speculative=False)
    config = data.draw(spec_configs(arrivals))
    compared, spec_rows = _run_and_compare(toy_model, oracle, arrivals, config)
    assert compared > 0
    if any(a.params.speculative and a.params.max_tokens >= 3 for a in arrivals):
        assert spec_rows > 0  # speculation really ran


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_speculative_with_stops_aborts_and_tight_kv_equals_oracle(toy_model, oracle, data) -> None:
    """Stops the request really produces (from the oracle's own run), aborts mid-cycle and a
    tight cache: every request not aborted equals the oracle, and all KV comes back."""
    arrivals = data.draw(workloads())
    for a in arrivals:
        free = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), SchedulerConfig())
        if free.token_ids and data.draw(st.booleans()):
            a.params = _with(a.params, stop_token_ids=[data.draw(st.sampled_from(free.token_ids))])
    aborts = {
        a.request_id: data.draw(st.integers(a.step, a.step + 30))
        for a in arrivals
        if data.draw(st.integers(0, 3)) == 0
    }
    config = data.draw(spec_configs(arrivals))
    _run_and_compare(toy_model, oracle, arrivals, config, aborts)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_speculative_padded_static_passes_equal_oracle(toy_model, oracle, data) -> None:
    """Draft and verify rows through the static padded decode path (a CUDA graph's)."""
    arrivals = data.draw(workloads())
    config = data.draw(spec_configs(arrivals))
    with mock.patch.dict(os.environ, {"RLT_DECODE_MODE": "padded"}):
        compared, _ = _run_and_compare(toy_model, oracle, arrivals, config)
    assert compared > 0


@pytest.mark.parametrize("threshold", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("draft_loops", [1, 2, 3])
def test_speculation_runs_and_accepts(toy_model, oracle, threshold, draft_loops) -> None:
    """Cycles really run (and, at the deeper drafts, accept) with the gate off and on, under
    preemption: long outputs, K = 4, tight incremental KV."""
    params = SamplingParams(
        max_tokens=14, temperature=0.0, min_loops=1, exit_threshold=threshold, ignore_eos=True
    )
    arrivals = [Arrival(f"s{i}", [7 + i, 21, 3 * i + 1, 40, 55], params, step=i) for i in range(4)]
    config = SchedulerConfig(
        block_size=2,
        num_blocks=36,
        max_num_seqs=4,
        prefill_chunk_size=4,
        max_num_batched_tokens=16,
        kv_admission=KVAdmission.INCREMENTAL,
        speculative_tokens=4,
        draft_loops=draft_loops,
    )
    record = run_workload(toy_model, config, arrivals)
    assert record.engine is not None
    spec = record.engine.scheduler.spec_stats
    assert spec.num_drafts > 0 and spec.num_draft_tokens > 0
    if draft_loops == D - 1:
        assert spec.num_accepted_tokens > 0
    compared = 0
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(record.finished[a.request_id], expected)
    assert compared >= 4 * 14 - 4  # near-ties aside, every token


def test_speculating_request_preempts_prefix_sharers_only_when_that_frees_blocks(
    toy_model, oracle
) -> None:
    """A request switching to speculation needs a block beyond its plain decode's while the
    pool is full and its only victims share their blocks with each other (a prefix hit):
    preempting one alone frees nothing, and its zero-cost readmission put it back in flight
    every step, so preemption kept throwing work away and the engine made no progress. It
    preempts only when the victims' release covers the shortfall."""

    def params(max_tokens: int, min_loops: int, max_loops: int, ignore_eos: bool):
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0, min_loops=min_loops, max_loops=max_loops,
            exit_threshold=1.0, ignore_eos=ignore_eos,
        )  # fmt: skip

    shared = [112, 23, 11, 383, 151, 142, 353, 1, 1]
    arrivals = [
        Arrival("r0", [1], params(3, 4, 4, True), 0),
        Arrival("r1", [*shared, 495, 218, 273, 10, 477, 77], params(7, 1, 4, False), 3),
        Arrival("r2", [*shared, 135, 500, 105, 328, 102, 366, 31, 180], params(7, 1, 4, False)),
        Arrival("r3", [*shared, 495, 218, 273, 10, 477, 1], params(5, 1, 1, False)),
    ]
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=18,
        prefill_chunk_size=1,
        split_prefill=True,
        block_size=2,
        num_blocks=48,
        kv_cache_dtype="auto",
        enable_prefix_caching=True,
        async_scheduling=True,
        kv_admission=KVAdmission.INCREMENTAL,
        token_sparse_prefill=False,
        speculative_tokens=1,
        draft_loops=1,
    )
    compared, spec_rows = _run_and_compare(toy_model, oracle, arrivals, config)
    assert spec_rows > 0
    assert compared == 3 + 7 + 7 + 5  # every token of every request (none stops early)
