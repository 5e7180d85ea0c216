"""Async follow-on rows under the events that end requests early: stop tokens hit while a
follow-on is in flight, aborts, and preemption from a tight KV cache. Every request that
was not aborted must still equal the serial oracle, and all KV must come back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from tests.engine_harness import assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import D, max_kv_blocks, workloads

pytestmark = pytest.mark.oracle


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_follow_ons_with_stops_aborts_and_tight_kv_equal_oracle(toy_model, oracle, data) -> None:
    arrivals = data.draw(workloads())
    # a stop token the request will really produce (from the oracle's own run), so it
    # finishes while its next loop is already in flight
    for a in arrivals:
        free = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), SchedulerConfig())
        if free.token_ids and data.draw(st.booleans()):
            stop = data.draw(st.sampled_from(free.token_ids))
            a.params = SamplingParams(
                **{
                    **{f: getattr(a.params, f) for f in a.params.__struct_fields__},
                    "stop_token_ids": [stop],
                }
            )
    aborts = {
        a.request_id: data.draw(st.integers(a.step, a.step + 30))
        for a in arrivals
        if data.draw(st.integers(0, 3)) == 0
    }
    aborts.pop(arrivals[0].request_id, None)  # one request always runs to the end: compared
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    need = max_kv_blocks(arrivals, block_size)
    mode = data.draw(st.sampled_from(["atomic", "split", "wcpb"]))
    config = SchedulerConfig(
        max_num_seqs=data.draw(st.integers(1, 4)),
        max_num_batched_tokens=data.draw(st.integers(1, 24)),
        prefill_chunk_size=data.draw(st.integers(1, 8)),
        split_prefill=mode != "atomic",
        wavefront_chunked_prefill=mode == "wcpb",
        block_size=block_size,
        num_blocks=need + data.draw(st.integers(0, need)),  # tight: preemption happens
        refill=True,
        async_scheduling=True,
        max_inflight_batches=data.draw(st.integers(2, 3)),
    )

    finished = run_workload(toy_model, config, arrivals, aborts=aborts).finished  # KV checked
    assert set(finished) == {a.request_id for a in arrivals}
    compared = 0
    for a in arrivals:
        if finished[a.request_id].finish_reason == "abort":
            assert a.request_id in aborts
            continue
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(
            finished[a.request_id], expected, f"{a.request_id} {config}"
        )
    assert compared > 0, "every comparison stopped at a near-tie: the run proved nothing"
