"""Continuous depth batching: rows at different loop depths share one core pass (refill),
versus the cohort baseline where exited rows idle until the whole cohort is done."""

from __future__ import annotations

from messages.sampling import SamplingParams
from services.scheduler.batch import TaskKind
from services.scheduler.config import SchedulerConfig
from tests.engine_harness import Arrival, run_workload

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, min_loops=1, exit_threshold=0.7,
                        ignore_eos=True)


def decode_depth_sets(record) -> list[set[int]]:
    return [
        {t.depth for t in b.tasks if t.kind == TaskKind.DECODE}
        for b in record.batches
        if any(t.kind == TaskKind.DECODE for t in b.tasks)
    ]


def run(toy_model, refill: bool):
    arrivals = [Arrival(f"r{i}", [3 + i, 40 + 7 * i, 11, 200 + i], PARAMS) for i in range(8)]
    config = SchedulerConfig(refill=refill, block_size=4, num_blocks=256, max_num_seqs=8)
    return run_workload(toy_model, config, arrivals)


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
    passes = lambda rec: sum(1 for b in rec.batches if any(  # noqa: E731
        t.kind == TaskKind.DECODE for t in b.tasks))
    assert passes(refill) < passes(cohort)
