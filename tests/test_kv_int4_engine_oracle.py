"""The engine under ``--kv-cache-dtype int4-delta`` equals the serial oracle applying its own
int4-delta codec (services/oracle/kv_codec.py), token for token and depth for depth, over
the randomized workloads of tests/test_engine_oracle.py: every prefill mode (chunks that
complete blocks mid-pass), prefix hits on sealed blocks, preemption (tight KV), async
scheduling and early exits (tokens that store no delta above their exit loop)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.config import KVAdmission, KVLayout, SchedulerConfig
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import D, max_kv_blocks, workloads

pytestmark = pytest.mark.oracle


@st.composite
def configs(draw: st.DrawFn, arrivals: list[Arrival]) -> SchedulerConfig:
    """The last-exited layout (int4-delta's only one) under every prefill mode, tight KV
    (preemption), prefix caching and async scheduling; blocks of 2 to 8 tokens, so prompts
    span several sealed blocks."""
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
        refill=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
    )


def test_int4_engine_equals_int4_oracle(toy_model, oracle) -> None:
    compared: list[int] = []  # tokens compared per request
    produced: list[int] = []  # tokens the oracle generated per request
    sealed: list[int] = []  # blocks sealed (coded) at the end of each run
    skipped: list[int] = []  # tokens a sealed block stores no delta for (early exits)

    @settings(
        max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
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
        for a in arrivals:
            finished = record.finished[a.request_id]
            expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
            compared.append(assert_matches_oracle(finished, expected, f"{a.request_id} {config}"))
            produced.append(len(expected.token_ids))

    check()
    print(
        f"int4-delta engine == oracle: {sum(compared)} of {sum(produced)} tokens compared, "
        f"{sum(sealed)} blocks sealed, {sum(skipped)} exited tokens without a delta"
    )
    assert sum(compared) > 0
    assert sum(sealed) > 0 and sum(skipped) > 0  # the runs read codes, exits included
    assert sum(compared) >= 0.8 * sum(produced), (sum(compared), sum(produced))
