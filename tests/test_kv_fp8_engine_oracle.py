"""The engine under ``--kv-cache-dtype fp8`` equals the serial oracle applying its own fp8
codec (services/oracle/kv_codec.py), token for token and depth for depth, over the same
randomized workloads and scheduling configurations as tests/test_engine_oracle.py: chunking,
prefix hits, preemption (tight KV), async scheduling and token-sparse prefill; and a request
resumed on another shard (a lost shard's streams) under fp8."""

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
    """Either KV layout under fp8. LAST_EXITED: every prefill mode, tight KV (preemption),
    prefix caching, async scheduling, token-sparse prefill where split prefill allows it;
    SHARED: atomic prefill with untruncated chunks (its results depend on chunk ends)."""
    layout = draw(st.sampled_from([KVLayout.LAST_EXITED, KVLayout.SHARED]))
    shared = layout == KVLayout.SHARED
    mode = "atomic" if shared else draw(st.sampled_from(["atomic", "split", "wcpb"]))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    need = max_kv_blocks(arrivals, block_size)
    tight = draw(st.booleans())
    seqs, chunk = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    budget = draw(st.integers(1, 24))
    return SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=max(budget, seqs * chunk) if shared else budget,
        prefill_chunk_size=chunk,
        split_prefill=mode != "atomic",
        wavefront_chunked_prefill=mode == "wcpb",
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)) if tight else need * len(arrivals) + 8,
        kv_layout=layout,
        kv_cache_dtype="fp8",
        refill=draw(st.booleans()),
        enable_prefix_caching=not shared and draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        token_sparse_prefill=mode != "atomic" and draw(st.booleans()),
    )


def test_fp8_engine_equals_fp8_oracle(toy_model, oracle) -> None:
    compared: list[int] = []  # tokens compared per request
    produced: list[int] = []  # tokens the oracle generated per request

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
        config = data.draw(configs(arrivals))
        record = run_workload(toy_model, config, arrivals)
        assert record.engine is not None
        assert record.engine.runner.k_cache.dtype == torch.uint8  # codes, not values
        assert set(record.finished) == {a.request_id for a in arrivals}
        for a in arrivals:
            finished = record.finished[a.request_id]
            expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
            compared.append(assert_matches_oracle(finished, expected, f"{a.request_id} {config}"))
            produced.append(len(expected.token_ids))

    check()
    # the comparison stops only at near-ties: it must have covered most tokens
    assert sum(compared) > 0
    assert sum(compared) >= 0.8 * sum(produced), (sum(compared), sum(produced))


@pytest.mark.parametrize("known", [1, 4, 11])
def test_a_request_resumed_on_another_fp8_shard_equals_the_fp8_oracle(
    toy_model, oracle, known: int
) -> None:
    """A shard lost mid-generation: admission resumes the request on another shard with the
    outputs already streamed (``KnownOutputs``), which prefills prompt and known tokens
    under its own fp8 KV and goes on. The whole run equals the fp8 oracle and an
    uninterrupted fp8 shard, tokens and exit depths; only the rest is streamed again."""
    config = SchedulerConfig(
        block_size=4, num_blocks=64, max_num_batched_tokens=8, prefill_chunk_size=4,
        enable_prefix_caching=True, kv_cache_dtype="fp8",
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, min_loops=1, exit_threshold=0.6
    )
    prompt = [89, 60, 174, 57, 195, 118, 75, 6]  # fp8 and auto part at its 4th token
    whole = LLMEngine(toy_model, config)
    whole.core.add_request("r", prompt, params)
    (final,) = [e for e in whole.run_until_done() if isinstance(e, FinishedEvent)]
    assert len(set(final.exit_depths)) > 1  # the replay must reproduce early exits
    expected = oracle_result(oracle, prompt, params.resolve(D, 512), config)
    assert assert_matches_oracle(final, expected, "uninterrupted") == 12
    auto_config = replace(config, kv_cache_dtype="auto")
    auto = oracle_result(oracle, prompt, params.resolve(D, 512), auto_config)
    assert auto.token_ids != expected.token_ids  # the comparison sees the codec

    resumed = LLMEngine(toy_model, config)
    known_outputs = KnownOutputs(final.token_ids[:known], final.exit_depths[:known])
    assert resumed.core.add_request("r", prompt, params, known_outputs=known_outputs) == []
    events = resumed.run_until_done()
    rest = [e for e in events if isinstance(e, TokenEvent)]
    (end,) = [e for e in events if isinstance(e, FinishedEvent)]
    assert [e.index for e in rest] == list(range(known, 12))
    assert assert_matches_oracle(end, expected, f"resumed after {known}") == 12
    assert resumed.scheduler.kv.num_free_blocks == config.num_blocks
