"""EngineCore's one failure policy, in-process: a batch that fails on the worker ends its
requests, and with async scheduling the prefix blocks it published at submission are
withdrawn, so no later request reads KV that was never written (DESIGN.md §6: a block is
claimable only once every batch that wrote it has succeeded)."""

from __future__ import annotations

import pytest

from messages.api import ErrorEvent, FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.scheduler.core.batch import ScheduledBatch
from services.worker.runner import ModelRunner
from tests.engine_harness import assert_matches_oracle, oracle_result

PROMPT = [5, 9, 33, 71, 2, 18, 44, 90, 7, 120, 64, 3]  # 3 full blocks of 4
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_loops=1)


def fail_batches(runner: ModelRunner, seqs: set[int]) -> None:
    """The runner applies these batches' deltas, then fails before computing anything:
    the KV they should have written is never written."""
    recurrent, prelude = runner._run_recurrent, runner._run_prelude

    def guard(real):  # type: ignore[no-untyped-def]
        def run(states):  # type: ignore[no-untyped-def]
            if runner.last_seq in seqs:
                raise RuntimeError(f"injected failure of batch {runner.last_seq}")
            return real(states)

        return run

    runner._run_recurrent = guard(recurrent)  # type: ignore[method-assign]
    runner._run_prelude = guard(prelude)  # type: ignore[method-assign]


def config(max_inflight: int, **kw: object) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=4,
        num_blocks=128,
        enable_prefix_caching=True,
        async_scheduling=True,
        split_prefill=False,  # batch 0 is a's whole prompt
        max_inflight_batches=max_inflight,
        **kw,  # type: ignore[arg-type]
    )


def run(engine: LLMEngine) -> dict[str, FinishedEvent | ErrorEvent]:
    ended: dict[str, FinishedEvent | ErrorEvent] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, FinishedEvent | ErrorEvent):
                assert event.request_id not in ended, "two terminal events"
                ended[event.request_id] = event
    engine.scheduler.kv.check_consistency()
    return ended


@pytest.mark.oracle
@pytest.mark.parametrize("codec", ["auto", "int4-delta"])
def test_blocks_of_a_failed_batch_are_withdrawn_before_anyone_claims_them(
    toy_model, oracle, codec: str
):
    cfg = config(max_inflight=2, kv_cache_dtype=codec)
    engine = LLMEngine(toy_model, cfg)
    fail_batches(engine.runner, {0})
    engine.add_request("a", PROMPT, PARAMS)
    engine.step()  # batch 0 (a's prefill) is submitted: async publishes its blocks now
    assert engine.scheduler.kv.cached_block_hashes()  # claimable while in flight
    engine.add_request("b", PROMPT, PARAMS)
    ended = run(engine)
    assert isinstance(ended["a"], ErrorEvent) and ended["a"].code == "internal"
    b = ended["b"]
    assert isinstance(b, FinishedEvent)
    assert b.num_cached_tokens == 0  # nothing of the failed batch was claimed
    assert assert_matches_oracle(b, oracle_result(oracle, PROMPT, PARAMS, cfg), "b") > 0
    assert engine.scheduler.kv.num_free_blocks == cfg.num_blocks


@pytest.mark.oracle
@pytest.mark.parametrize("codec", ["auto", "int4-delta"])
def test_a_request_that_claimed_blocks_of_a_failed_batch_is_recomputed(
    toy_model, oracle, codec: str
):
    cfg = config(max_inflight=3, kv_cache_dtype=codec)
    batches: list[ScheduledBatch] = []
    engine: LLMEngine

    def on_batch(batch: ScheduledBatch) -> None:
        batches.append(batch)
        if batch.seq == 0:  # b arrives while a's prefill is in flight
            engine.add_request("b", PROMPT, PARAMS)

    engine = LLMEngine(toy_model, cfg, on_batch=on_batch)
    fail_batches(engine.runner, {0})
    engine.add_request("a", PROMPT, PARAMS)
    engine.step()  # fills 3 batches: a's prefill, a's follow-on, b's prefill on a's blocks
    b_first = engine.scheduler.requests["b"]
    assert b_first.num_cached_tokens == 8, "b claimed a's blocks before batch 0 failed"
    ended = run(engine)
    assert isinstance(ended["a"], ErrorEvent)
    b = ended["b"]
    assert isinstance(b, FinishedEvent)
    # b was recomputed from token 0 and equals the oracle
    assert assert_matches_oracle(b, oracle_result(oracle, PROMPT, PARAMS, cfg), "b") > 0
    assert engine.scheduler.stats.num_preemptions >= 1
    assert engine.scheduler.kv.num_free_blocks == cfg.num_blocks
    # the withdrawal reached the event plane
    removed = [
        e
        for env in [engine.scheduler.take_prefix_events()]
        if env is not None
        for e in env.events
        if type(e).__name__ == "BlockRemoved"
    ]
    assert removed


@pytest.mark.unit
def test_sync_scheduling_publishes_nothing_for_a_failed_batch(toy_model):
    cfg = SchedulerConfig(
        block_size=4,
        num_blocks=128,
        enable_prefix_caching=True,
        split_prefill=False,
        async_scheduling=False,
    )
    engine = LLMEngine(toy_model, cfg)
    fail_batches(engine.runner, {0})
    engine.add_request("a", PROMPT, PARAMS)
    ended = run(engine)
    assert isinstance(ended["a"], ErrorEvent)
    assert not engine.scheduler.kv.cached_block_hashes()
