"""Self-speculative decoding under ``--kv-cache-dtype int4-delta`` changes nothing a greedy
request receives: tokens and exit depths equal the serial oracle applying its own
int4-delta codec (plain decoding), over draft lengths and depths, blocks of 2 and 4 (so a
cycle spans several blocks), the exit gate on and off, chunking, prefix hits, async
scheduling and tight KV (preemption). A cycle seals the blocks its queries read coded, as
plain decoding would have sealed them; a block holding positions a rejected draft wrote
keeps its tails and is sealed again after they are written again (docs/speculative.md,
services/worker/kv_int4/book.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.sampling import SamplingParams
from services.common.config import KVAdmission, SchedulerConfig
from services.scheduler.core.scheduler import Scheduler
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload
from tests.engine_strategies import D, max_kv_blocks, workloads

pytestmark = pytest.mark.oracle


@st.composite
def int4_spec_configs(draw: st.DrawFn, arrivals: list[Arrival]) -> SchedulerConfig:
    mode = draw(st.sampled_from(["atomic", "split", "wcpb"]))
    block_size = draw(st.sampled_from([2, 4]))
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
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        enable_prefix_caching=draw(st.booleans()),
        kv_cache_dtype="int4-delta",
        speculative_tokens=draw(st.sampled_from([1, 2, 3, 5, 8])),
        speculative_auto=draw(st.booleans()),
        draft_loops=draw(st.integers(1, D - 1)),
    )


def _run_and_compare(toy_model, oracle, arrivals, config) -> tuple[int, int, Scheduler]:
    """(tokens compared with the int4 oracle, tokens the oracle produced, the scheduler)."""
    record = run_workload(toy_model, config, arrivals)  # KV reclaimed: checked
    assert record.engine is not None
    runner = record.engine.runner
    assert runner.k_cache.dtype == torch.uint8  # codes, not values
    assert set(record.finished) == {a.request_id for a in arrivals}
    compared = produced = 0
    for a in arrivals:
        finished = record.finished[a.request_id]
        streamed = record.tokens.get(a.request_id, [])
        assert [t.index for t in streamed] == list(range(len(finished.token_ids)))
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(finished, expected, f"{a.request_id} {config}")
        produced += len(expected.token_ids)
    return compared, produced, record.engine.scheduler


def test_int4_speculative_greedy_equals_int4_oracle(toy_model, oracle) -> None:
    totals = {"compared": 0, "produced": 0, "spec_rows": 0, "drafted": 0, "accepted": 0}

    @settings(
        # fixed examples: a KV code one float32 rounding from its boundary may flip between
        # engine and oracle (docs/kv_codecs.md, "What is exact"), so CI draws no new ones
        derandomize=True,
        max_examples=40,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        arrivals = data.draw(workloads())
        config = data.draw(int4_spec_configs(arrivals))
        compared, produced, scheduler = _run_and_compare(toy_model, oracle, arrivals, config)
        totals["compared"] += compared
        totals["produced"] += produced
        spec = scheduler.spec_stats
        totals["spec_rows"] += spec.num_spec_rows
        totals["drafted"] += spec.num_draft_tokens
        totals["accepted"] += spec.num_accepted_tokens

    check()
    print(f"int4-delta speculative == int4 oracle: {totals}")
    assert totals["spec_rows"] > 0  # speculation really ran under int4-delta
    assert 0 < totals["accepted"] < totals["drafted"]  # accepted and rejected drafts
    assert totals["compared"] > 0
    assert totals["compared"] >= 0.8 * totals["produced"], totals


@pytest.mark.parametrize(
    ("draft_loops", "k", "block_size", "threshold"),
    [(1, 4, 2, 0.7), (3, 4, 2, 1.0), (2, 8, 2, 1.0), (1, 8, 4, 0.7), (2, 3, 4, 1.0)],
)
def test_int4_speculation_runs_rejects_and_preempts(
    toy_model, oracle, draft_loops, k, block_size, threshold
) -> None:
    """Cycles cross blocks (K up to 8 over blocks of 2 and 4), accept and reject, with the
    gate on (threshold 0.7) and off (1.0), under tight incremental KV (preemption); every
    token equals the int4 oracle's, and the same run under auto gives other tokens (the
    comparison sees the codec)."""
    params = SamplingParams(
        max_tokens=14, temperature=0.0, min_loops=1, exit_threshold=threshold, ignore_eos=True
    )
    arrivals = [Arrival(f"s{i}", [7 + i, 21, 3 * i + 1, 40, 55], params, step=i) for i in range(4)]
    config = SchedulerConfig(
        block_size=block_size,
        num_blocks={2: 36, 4: 22}[block_size],
        max_num_seqs=4,
        prefill_chunk_size=4,
        max_num_batched_tokens=40,
        kv_admission=KVAdmission.INCREMENTAL,
        kv_cache_dtype="int4-delta",
        speculative_tokens=k,
        draft_loops=draft_loops,
    )
    compared, produced, scheduler = _run_and_compare(toy_model, oracle, arrivals, config)
    spec = scheduler.spec_stats
    assert spec.num_spec_rows > 0 and spec.num_accepted_tokens > 0
    assert spec.num_accepted_tokens < spec.num_draft_tokens  # rejected drafts rewritten
    assert scheduler.stats.num_preemptions > 0
    assert produced == 4 * 14
    assert compared >= produced - 4  # near-ties aside, every token
    auto = run_workload(toy_model, dataclasses.replace(config, kv_cache_dtype="auto"), arrivals)
    int4 = [oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config) for a in arrivals]
    assert [auto.finished[a.request_id].token_ids for a in arrivals] != [e.token_ids for e in int4]


@st.composite
def long_outputs(draw: st.DrawFn) -> tuple[list[Arrival], SchedulerConfig]:
    """Few requests with long greedy outputs (many cycles, each over several small blocks),
    any K, draft depth and gate, tight KV (preemption) or not, sync or async."""
    params = SamplingParams(
        max_tokens=draw(st.integers(8, 16)),
        temperature=0.0,
        min_loops=1,
        exit_threshold=draw(st.sampled_from([1.0, 0.7, 0.5])),
        ignore_eos=True,
    )
    arrivals = [
        Arrival(
            f"l{i}",
            draw(st.lists(st.integers(1, 499), min_size=1, max_size=9)),
            params,
            step=draw(st.sampled_from([0, 2, 5])),
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    block_size = draw(st.sampled_from([2, 4]))
    need = max_kv_blocks(arrivals, block_size)
    config = SchedulerConfig(
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)) if draw(st.booleans()) else 4 * need,
        max_num_seqs=draw(st.integers(1, 3)),
        prefill_chunk_size=draw(st.integers(2, 8)),
        max_num_batched_tokens=draw(st.integers(9, 40)),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        async_scheduling=draw(st.booleans()),
        kv_cache_dtype="int4-delta",
        speculative_tokens=draw(st.integers(1, 8)),
        draft_loops=draw(st.integers(1, D - 1)),
    )
    return arrivals, config


def test_int4_speculative_long_outputs_equal_int4_oracle(toy_model, oracle) -> None:
    totals = {"compared": 0, "produced": 0, "drafted": 0, "accepted": 0, "preemptions": 0}

    @settings(
        # fixed examples: a KV code one float32 rounding from its boundary may flip between
        # engine and oracle (docs/kv_codecs.md, "What is exact"), so CI draws no new ones
        derandomize=True,
        max_examples=12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(case=long_outputs())
    def check(case: tuple[list[Arrival], SchedulerConfig]) -> None:
        arrivals, config = case
        compared, produced, scheduler = _run_and_compare(toy_model, oracle, arrivals, config)
        totals["compared"] += compared
        totals["produced"] += produced
        totals["drafted"] += scheduler.spec_stats.num_draft_tokens
        totals["accepted"] += scheduler.spec_stats.num_accepted_tokens
        totals["preemptions"] += scheduler.stats.num_preemptions

    check()
    print(f"int4-delta speculative, long outputs == int4 oracle: {totals}")
    assert 0 < totals["accepted"] < totals["drafted"]
    assert totals["compared"] > 0
    assert totals["compared"] >= 0.8 * totals["produced"], totals
