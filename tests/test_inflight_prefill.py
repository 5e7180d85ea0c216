"""Sharing a prefix that is still being prefilled (``share_inflight_prefill``): a request
whose next prompt block a running prefill is computing waits for it to be published and
claims it, instead of computing the same prefix a second time; outputs equal the oracle."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from prometheus_client import generate_latest

from messages.api import FinishedEvent
from messages.batch import RowKind
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.scheduler.core.running import preempt
from services.scheduler.driver.telemetry import SchedulerTelemetry
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload

D = 4
PREFIX = [17, 4, 250, 31, 99, 8, 61, 120, 7, 300, 42, 11, 5, 19, 77, 23]  # 4 blocks of 4
OTHER = [3, 141, 59, 26, 53, 58, 97, 93]
GREEDY = SamplingParams(
    max_tokens=5, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
)
MODES = {
    "atomic": {"split_prefill": False},
    "split": {"split_prefill": True},
    "wcpb": {"wavefront_chunked_prefill": True},
}


def _config(**overrides) -> SchedulerConfig:
    base = dict(
        block_size=4,
        num_blocks=256,
        prefill_chunk_size=4,
        max_num_batched_tokens=12,
        enable_prefix_caching=True,
    )
    return SchedulerConfig(**{**base, **overrides})


def _prompt_rows(record, request_id: str) -> int:
    """Prompt positions ``request_id`` ran through the core's first loop."""
    return sum(
        t.token_count
        for b in record.batches
        for t in b.tasks
        if t.request.request_id == request_id and t.kind is RowKind.PREFILL and t.depth == 0
    )


@pytest.mark.oracle
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_requests_arriving_together_compute_their_shared_prefix_once(
    toy_model, oracle, mode, async_scheduling
):
    arrivals = [
        Arrival("writer", [*PREFIX, 2, 3], GREEDY),
        Arrival("reader", [*PREFIX, 9, 9, 9], GREEDY),
    ]
    config = _config(async_scheduling=async_scheduling, **MODES[mode])
    shared = run_workload(toy_model, config, arrivals)
    alone = run_workload(
        toy_model, dataclasses.replace(config, share_inflight_prefill=False), arrivals
    )

    # the reader waited for the writer's four prefix blocks and claimed them all
    assert shared.finished["reader"].num_cached_tokens == 16
    assert _prompt_rows(shared, "reader") == 3
    assert shared.engine.scheduler.stats.num_prefix_deferrals > 0
    # without sharing, both arrive before any block is published: both compute the prefix
    assert alone.finished["reader"].num_cached_tokens == 0
    assert _prompt_rows(alone, "reader") == 19
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert_matches_oracle(shared.finished[a.request_id], expected, f"{mode} {a}")
        assert shared.finished[a.request_id].token_ids == alone.finished[a.request_id].token_ids


@pytest.mark.unit
def test_a_waiting_reader_does_not_hold_back_the_requests_behind_it(toy_model) -> None:
    """The reader waits for data, not for room: an unrelated request queued after it is
    admitted at once."""
    config = _config(wavefront_chunked_prefill=True, async_scheduling=False)
    engine = LLMEngine(toy_model, config)
    engine.add_request("writer", [*PREFIX, 2, 3], GREEDY)
    engine.add_request("reader", [*PREFIX, 9], GREEDY)
    engine.add_request("other", [*OTHER, 1], GREEDY)
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"writer", "other"}
    engine.run_until_done()
    assert engine.scheduler.stats.num_prefix_deferrals > 0


@pytest.mark.oracle
def test_the_reader_runs_cold_when_the_writer_is_aborted(toy_model, oracle) -> None:
    """A writer that leaves before publishing releases its readers: they compute the
    prefix themselves and still equal the oracle."""
    config = _config(wavefront_chunked_prefill=True, async_scheduling=True)
    reader = Arrival("reader", [*PREFIX, 9, 9], GREEDY)
    record = run_workload(
        toy_model,
        config,
        [Arrival("writer", [*PREFIX, 2, 3], GREEDY), reader],
        aborts={"writer": 0},
    )
    assert record.finished["writer"].finish_reason == "abort"
    assert record.engine.scheduler.stats.num_prefix_deferrals == 1  # parked before the abort
    assert record.finished["reader"].num_cached_tokens < 16
    expected = oracle_result(oracle, reader.prompt, reader.params.resolve(D, 512), config)
    assert_matches_oracle(record.finished["reader"], expected, "reader after abort")


@pytest.mark.unit
def test_the_load_report_counts_a_prefix_in_flight_once(toy_model) -> None:
    """Routers weigh a shard's due prefill: readers of a prefix being computed there add
    only their own suffixes, with or without any of its blocks published yet."""
    # one seat: the writer runs and the others wait, whatever sharing decides
    config = _config(wavefront_chunked_prefill=True, async_scheduling=False, max_num_seqs=1)
    engine = LLMEngine(toy_model, config)
    scheduler = engine.scheduler
    engine.add_request("writer", [*PREFIX, 2, 3], GREEDY)
    engine.add_request("reader1", [*PREFIX, 9, 9, 9], GREEDY)
    engine.add_request("reader2", [*PREFIX[:8], 5, 5], GREEDY)  # shares two blocks
    engine.add_request("cold", [*OTHER, 1], GREEDY)
    # nothing runs yet: the four shared blocks are computed once, by whichever goes first,
    # plus each prompt's own tail
    assert scheduler.num_prefill_tokens_due() == 16 + 2 + 3 + 2 + 9
    engine.step()  # the writer alone is admitted; its blocks are in flight
    assert [r.request_id for r in scheduler.running] == ["writer"]
    assert scheduler.num_prefill_tokens_due() == 3 + 2 + 9
    engine.run_until_done()
    # without sharing, every waiting prompt is computed whole
    off = LLMEngine(toy_model, dataclasses.replace(config, share_inflight_prefill=False))
    off.add_request("writer", [*PREFIX, 2, 3], GREEDY)
    off.add_request("reader1", [*PREFIX, 9, 9, 9], GREEDY)
    assert off.scheduler.num_prefill_tokens_due() == 18 + 19


@pytest.mark.unit
def test_a_less_urgent_writer_is_not_waited_for(toy_model) -> None:
    """A reader of higher priority than the running prefill writing its prefix does not
    wait for it (that writer's rows are selected after everything more urgent)."""
    config = _config(wavefront_chunked_prefill=True, async_scheduling=False)
    low = msgspec.structs.replace(GREEDY, priority=5)
    engine = LLMEngine(toy_model, config)
    engine.add_request("writer", [*PREFIX, 2, 3], low)
    engine.step()
    engine.add_request("urgent", [*PREFIX, 9, 9], GREEDY)
    engine.add_request("patient", [*PREFIX, 8, 8], msgspec.structs.replace(GREEDY, priority=9))
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"writer", "urgent"}  # patient waits for the writer's blocks
    assert engine.scheduler.stats.num_prefix_deferrals == 1
    engine.run_until_done()


@pytest.mark.unit
def test_parked_readers_are_looked_at_when_their_writer_moves_not_every_step(toy_model):
    """A burst of readers over a prefix in flight costs a look per reader per published
    block, not per step: the step loop stays cheap however many wait."""
    config = _config(wavefront_chunked_prefill=True, async_scheduling=True,
                     max_num_batched_tokens=6, prefill_chunk_size=2)  # fmt: skip
    engine = LLMEngine(toy_model, config)
    engine.add_request("writer", [*PREFIX, 2, 3], GREEDY)
    readers = [f"reader{i}" for i in range(40)]
    for i, rid in enumerate(readers):
        engine.add_request(rid, [*PREFIX, i % 7, 1], GREEDY)
    steps_waited = 0
    scheduler = engine.scheduler
    while not any(r.request_id.startswith("reader") for r in scheduler.running):
        engine.step()
        steps_waited += 1
    parks = scheduler.stats.num_prefix_deferrals
    assert parks <= len(readers) * 4  # at most once per awaited block (4 shared blocks)
    assert steps_waited > 4  # so one look per step would have been more
    events = engine.run_until_done()
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    assert all(finished[rid].num_cached_tokens == 16 for rid in readers)


@pytest.mark.unit
def test_parks_are_exported_and_survive_a_scheduler_reset(toy_model) -> None:
    """``rlt:prefix_inflight_waits_total`` counts parks, and keeps counting up when the
    driver builds a new Scheduler (a reset after a lost worker)."""
    config = _config(wavefront_chunked_prefill=True, async_scheduling=False)
    engines = []
    for _ in range(2):
        engine = LLMEngine(toy_model, config)
        engine.add_request("writer", [*PREFIX, 2, 3], GREEDY)
        engine.add_request("reader", [*PREFIX, 9], GREEDY)
        engine.run_until_done()
        engines.append(engine)
    current = [engines[0].scheduler]
    telemetry = SchedulerTelemetry(lambda: current[0], total_ut_steps=D, prefix_caching=True)

    def waits() -> float:
        text = generate_latest(telemetry.registry).decode()
        (line,) = [x for x in text.splitlines() if x.startswith("rlt:prefix_inflight_waits_total")]
        return float(line.split()[-1])

    # parked once per shared block (the writer publishes one per step here)
    first, second = (e.scheduler.stats.num_prefix_deferrals for e in engines)
    assert first == second == 4
    assert waits() == 4
    current[0] = engines[1].scheduler
    assert waits() == 8


@pytest.mark.oracle
def test_a_preempted_writer_hands_its_readers_back(toy_model, oracle) -> None:
    """The writer is preempted mid-prefill: its parked reader is queued again, waits for the
    writer's second try (the writer is ahead of it in the queue) and still claims the
    prefix; both equal the oracle and every KV block comes back."""
    config = _config(wavefront_chunked_prefill=True, async_scheduling=False)
    engine = LLMEngine(toy_model, config)
    writer = Arrival("writer", [*PREFIX, 2, 3], GREEDY)
    reader = Arrival("reader", [*PREFIX, 9, 9], GREEDY)
    for a in (writer, reader):
        engine.add_request(a.request_id, a.prompt, a.params)
    engine.step()
    scheduler = engine.scheduler
    assert [r.request_id for r in scheduler.running] == ["writer"]
    preempt(scheduler._state, scheduler.requests["writer"])
    events = engine.run_until_done()
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    assert finished["reader"].num_cached_tokens == 16
    assert scheduler.stats.num_preemptions == 1
    for a in (writer, reader):
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert_matches_oracle(finished[a.request_id], expected, a.request_id)
    scheduler.kv.check_consistency()
    assert scheduler.kv.num_free_blocks == config.num_blocks
