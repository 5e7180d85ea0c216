"""The engine equals the serial single-request oracle, token for token and depth for depth,
over randomized workloads and every scheduling configuration (DESIGN.md §6)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.sampling import SamplingParams
from services.common.config import KVAdmission, KVLayout, SchedulerConfig
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import D, max_kv_blocks, workloads

pytestmark = pytest.mark.oracle


@st.composite
def configs(draw: st.DrawFn, arrivals: list[Arrival], layout: KVLayout) -> SchedulerConfig:
    mode = draw(st.sampled_from(["atomic", "split", "wcpb"]))
    if layout == KVLayout.SHARED:
        mode = "atomic"
    chunk = draw(st.integers(1, 8))
    seqs = draw(st.integers(1, 4))
    budget = draw(st.integers(1, 24))
    if layout == KVLayout.SHARED:
        # SHARED's result depends on where chunks end: keep chunks untruncated
        budget = max(budget, seqs * chunk)
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    need = max_kv_blocks(arrivals, block_size)
    tight = draw(st.booleans())
    num_blocks = need + draw(st.integers(0, need)) if tight else need * len(arrivals) + 8
    return SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        prefill_chunk_size=chunk,
        split_prefill=mode != "atomic",
        wavefront_chunked_prefill=mode == "wcpb",
        block_size=block_size,
        num_blocks=num_blocks,
        kv_layout=layout,
        refill=draw(st.booleans()),
        enable_prefix_caching=layout == KVLayout.LAST_EXITED and draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        max_inflight_batches=draw(st.integers(2, 3)),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        kv_watermark=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        max_admission_bypasses=draw(st.integers(0, 4)),
    )


def check_against_oracle(toy_model, oracle, arrivals, config) -> None:
    record = run_workload(toy_model, config, arrivals)
    assert set(record.finished) == {a.request_id for a in arrivals}
    compared = 0
    for a in arrivals:
        finished = record.finished[a.request_id]
        # the token stream and the finished event agree
        streamed = record.tokens.get(a.request_id, [])
        assert [t.index for t in streamed] == list(range(len(finished.token_ids)))
        assert [t.token_id for t in streamed] == finished.token_ids
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(finished, expected, f"{a.request_id} {config}")
    assert compared > 0, "every comparison stopped at a near-tie: the run proved nothing"


SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(data=st.data())
def test_last_exited_engine_equals_oracle(toy_model, oracle, data) -> None:
    arrivals = data.draw(workloads())
    config = data.draw(configs(arrivals, KVLayout.LAST_EXITED))
    check_against_oracle(toy_model, oracle, arrivals, config)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_shared_layout_engine_equals_oracle(toy_model, oracle, data) -> None:
    arrivals = data.draw(workloads())
    config = data.draw(configs(arrivals, KVLayout.SHARED))
    check_against_oracle(toy_model, oracle, arrivals, config)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_padded_static_decode_passes_equal_oracle(toy_model, oracle, data) -> None:
    """The static padded decode path (what a CUDA graph replays), run eagerly on the CPU."""
    layout = data.draw(st.sampled_from([KVLayout.LAST_EXITED, KVLayout.SHARED]))
    arrivals = data.draw(workloads())
    config = data.draw(configs(arrivals, layout))
    with mock.patch.dict(os.environ, {"RLT_DECODE_MODE": "padded"}):
        check_against_oracle(toy_model, oracle, arrivals, config)


def test_preemption_under_pressure_still_equals_oracle(toy_model, oracle) -> None:
    """Tight KV forces recompute-preemption (with replayed exit depths) mid-decode."""
    params = SamplingParams(
        max_tokens=12, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
    )
    arrivals = [
        Arrival(f"p{i}", [10 + i, 20, 30 + i, 40, 50, 60 + i], params, step=i) for i in range(4)
    ]
    # incremental admission, so that the pressure does preempt (reserve never would)
    config = SchedulerConfig(
        block_size=2,
        num_blocks=40,
        max_num_seqs=4,
        prefill_chunk_size=4,
        max_num_batched_tokens=16,
        kv_admission=KVAdmission.INCREMENTAL,
    )
    record = run_workload(toy_model, config, arrivals)
    assert record.engine is not None
    assert record.engine.scheduler.stats.num_preemptions > 0
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert assert_matches_oracle(record.finished[a.request_id], expected) >= 6
