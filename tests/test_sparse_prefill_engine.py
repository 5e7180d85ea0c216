"""Token-sparse prefill in the engine equals the serial oracle's, token for token and exit
depth for exit depth, across windows, retentions, chunk sizes, budgets (fragments), split
and wavefront prefill, prefix caching, KV pressure (preemption) and async scheduling."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.sampling import SamplingParams
from services.common.config import KVAdmission, SchedulerConfig
from services.common.sparse_prefill import FLASHLOOP_RETENTION
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import VOCAB_TRAINED, D, max_kv_blocks

pytestmark = pytest.mark.oracle

RETENTIONS = [
    FLASHLOOP_RETENTION,
    (1.0, 0.5, 0.5, 0.25),
    (1.0, 1.0, 1.0, 0.3),
    (1.0, 1.0, 0.6, 0.6),
]


@st.composite
def sparse_workloads(draw: st.DrawFn) -> list[Arrival]:
    """Prompts of up to 40 tokens, often sharing a prefix; most sparse, some dense."""
    shared = draw(st.lists(st.integers(1, VOCAB_TRAINED), min_size=4, max_size=24))
    arrivals = []
    for i in range(draw(st.integers(1, 4))):
        retention = draw(st.sampled_from([None, *RETENTIONS]))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 6)),
            temperature=0.0,
            min_loops=draw(st.integers(1, 2)),
            exit_threshold=draw(st.sampled_from([1.0, 0.7])),
            ignore_eos=True,
            token_sparse_prefill=draw(st.sampled_from([True, True, False])),
            prefill_retention=None if retention is None else list(retention),
        )
        if params.token_sparse_prefill is False:
            params.prefill_retention = None
        tail = draw(st.lists(st.integers(1, VOCAB_TRAINED), min_size=1, max_size=16))
        prompt = (shared if draw(st.booleans()) else []) + tail
        arrivals.append(Arrival(f"r{i}", prompt, params, step=draw(st.sampled_from([0, 0, 2, 9]))))
    return arrivals


@st.composite
def sparse_configs(draw: st.DrawFn, arrivals: list[Arrival]) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    window = block_size * draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    chunk = draw(st.integers(1, 12))
    seqs = draw(st.integers(1, 4))
    need = max_kv_blocks(arrivals, block_size)
    tight = draw(st.booleans())
    return SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        prefill_chunk_size=chunk,
        split_prefill=True,
        wavefront_chunked_prefill=draw(st.booleans()),
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)) if tight else need * len(arrivals) + 8,
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        max_inflight_batches=draw(st.integers(2, 3)),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        sparse_window=window,
    )


def check(toy_model, oracle, arrivals: list[Arrival], config: SchedulerConfig) -> int:
    record = run_workload(toy_model, config, arrivals)
    compared = 0
    for a in arrivals:
        finished = record.finished[a.request_id]
        streamed = record.tokens.get(a.request_id, [])
        assert [t.token_id for t in streamed] == finished.token_ids
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(finished, expected, f"{a.request_id} {config}")
    return compared


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sparse_engine_equals_oracle(toy_model, oracle, data) -> None:
    arrivals = data.draw(sparse_workloads())
    config = data.draw(sparse_configs(arrivals))
    check(toy_model, oracle, arrivals, config)
