"""Continuous depth batching: rows at different loop depths share one core pass (refill),
versus the cohort baseline where exited rows idle until the whole cohort is done."""

from __future__ import annotations

import pytest

from messages.api import ErrorEvent, FinishedEvent
from messages.batch import RowKind
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from tests.engine_harness import Arrival, run_workload

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(
    max_tokens=12, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
)


def decode_depth_sets(record) -> list[set[int]]:
    return [
        {t.depth for t in b.tasks if t.kind == RowKind.DECODE}
        for b in record.batches
        if any(t.kind == RowKind.DECODE for t in b.tasks)
    ]


def run(toy_model, refill: bool, **overrides):
    arrivals = [Arrival(f"r{i}", [3 + i, 40 + 7 * i, 11, 200 + i], PARAMS) for i in range(8)]
    # atomic prefill and sync scheduling unless a test says otherwise (the baseline the
    # comparisons below are stated against)
    overrides = {"split_prefill": False, "async_scheduling": False, **overrides}
    config = SchedulerConfig(
        refill=refill, block_size=4, num_blocks=256, max_num_seqs=8, **overrides
    )
    return run_workload(toy_model, config, arrivals)


def core_passes(record) -> int:
    assert record.engine is not None
    return record.engine.runner.num_core_passes


def assert_same_results(a, b) -> None:
    assert a.finished.keys() == b.finished.keys()
    for rid, fin in a.finished.items():
        assert (b.finished[rid].token_ids, b.finished[rid].exit_depths) == (
            fin.token_ids,
            fin.exit_depths,
        )


def test_refill_mixes_depths_in_one_core_pass(toy_model) -> None:
    record = run(toy_model, refill=True)
    assert any(len(depths) >= 2 for depths in decode_depth_sets(record))


def test_no_refill_keeps_cohorts_in_lockstep_and_needs_more_passes(toy_model) -> None:
    refill = run(toy_model, refill=True)
    cohort = run(toy_model, refill=False)
    # cohort batching: every decode pass holds rows of a single depth
    assert all(len(depths) == 1 for depths in decode_depth_sets(cohort))
    # same tokens either way (scheduling never changes results) ...
    for rid, fin in refill.finished.items():
        assert cohort.finished[rid].token_ids == fin.token_ids
        assert cohort.finished[rid].exit_depths == fin.exit_depths

    # ... but refill needs fewer core passes for the same decode work
    def decode_passes(rec) -> int:
        return sum(1 for b in rec.batches if any(t.kind == RowKind.DECODE for t in b.tasks))

    assert decode_passes(refill) < decode_passes(cohort)


def test_async_refill_keeps_in_flight_requests_in_every_pass(toy_model) -> None:
    # Async scheduling builds batch N+1 before batch N's exits are known. Without follow-on
    # rows every request with a row in flight sat out the next batch, so the decode rows
    # split over alternate passes (~1.45x the passes of sync). With them the worker resolves
    # each request's next loop from batch N's result and the pass count matches sync's.
    sync = run(toy_model, refill=True)
    for inflight in (2, 3):
        asy = run(toy_model, refill=True, async_scheduling=True, max_inflight_batches=inflight)
        assert_same_results(sync, asy)
        follow_ons = [t for b in asy.batches for t in b.tasks if t.kind is RowKind.FOLLOW_ON]
        assert follow_ons
        # a follow-on may outlive its request by one wasted row (the in-flight row ended it)
        assert core_passes(asy) <= core_passes(sync) + inflight


def test_async_cohort_batching_sends_no_follow_ons(toy_model) -> None:
    # cohort batching holds exited rows back on purpose: nothing to follow on
    cohort = run(toy_model, refill=False, async_scheduling=True)
    assert not any(t.kind is RowKind.FOLLOW_ON for b in cohort.batches for t in b.tasks)
    assert_same_results(run(toy_model, refill=False), cohort)


def test_follow_ons_of_a_failed_batch_are_skipped_and_the_rest_go_on(toy_model) -> None:
    # r4..r7 arrive while r0..r3 decode; the device fails their (atomic) prefill batch. The
    # batch after it was already built with follow-on rows for r4..r7's first decode: the
    # worker skips those (their predecessor never ran) instead of failing that batch too,
    # and r0..r3 finish exactly as in a clean run.
    config = SchedulerConfig(
        block_size=4, num_blocks=256, max_num_seqs=8, async_scheduling=True, split_prefill=False
    )
    early = [Arrival(f"r{i}", [3 + i, 40 + 7 * i, 11, 200 + i], PARAMS) for i in range(4)]
    clean = run_workload(toy_model, config, early)
    engine = LLMEngine(toy_model, config)
    runner = engine.runner
    real_run, real_execute = runner._run_recurrent, runner.execute
    failed: list[bool] = []
    skipped: list[str] = []

    def flaky_run(states):
        if not failed and any(s.row.request_id == "r4" for s in states):
            failed.append(True)
            raise RuntimeError("device fell over")
        return real_run(states)

    def recording_execute(batch):
        result = real_execute(batch)
        skipped.extend(batch.rows[r.row_index].request_id for r in result.rows if r.skipped)
        return result

    runner._run_recurrent, runner.execute = flaky_run, recording_execute
    for a in early:
        engine.add_request(a.request_id, a.prompt, a.params)
    events = []
    for _ in range(6):
        events += engine.step()
    for i in range(4, 8):
        engine.add_request(f"r{i}", [5 + i, 9, 300 + i], PARAMS)
    events += engine.run_until_done()

    assert failed and set(skipped) == {"r4", "r5", "r6", "r7"}
    errors = {e.request_id for e in events if isinstance(e, ErrorEvent)}
    assert errors == {"r4", "r5", "r6", "r7"}
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    assert finished.keys() == clean.finished.keys()
    for rid, fin in clean.finished.items():
        assert (finished[rid].token_ids, finished[rid].exit_depths) == (
            fin.token_ids,
            fin.exit_depths,
        )
    assert engine.scheduler.kv.num_free_blocks == config.num_blocks
