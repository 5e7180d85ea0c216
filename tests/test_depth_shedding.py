"""Depth shedding under overload (``--overload-policy shed-depth``): the budget controller's
rules, the per-token budget on the wire and at the worker, and exactness: every token equals
the serial oracle run with the budget that token ran under; under capacity the policy
changes nothing."""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from messages.api import FinishedEvent
from messages.batch import Batch, BatchKind, BatchRow, RowKind, WorkerSampling
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, KVLayout, ModelLimits, SchedulerConfig
from services.common.flags import add_engine_flags, engine_args, scheduler_config_from_args
from services.engine.engine import LLMEngine
from services.oracle import SerialOracle
from services.scheduler.core.depth_budget import (
    RESTORE_DWELL_STEPS,
    SHED_DWELL_STEPS,
    DepthBudget,
    token_budget,
)
from services.scheduler.core.request import Request
from services.scheduler.core.state import SchedulerState, new_kv
from services.scheduler.driver.telemetry import SchedulerTelemetry
from services.worker.model.ouro import OuroModel
from services.worker.passes.rows import RowCursor, live_rows
from services.worker.passes.static_decode import DecodeMode
from services.worker.sim import SimRunner
from tests.engine_harness import Arrival, assert_matches_oracle, run_workload

D = 4
SHED = {"overload_policy": "shed-depth"}
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=512, max_position_embeddings=512, eos_token_ids=(0,)
)


# ---------------------------------------------------------------------- the controller
def _request(i: int, **params: object) -> Request:
    resolved = LIMITS.resolve(SamplingParams(max_tokens=4, **params))  # type: ignore[arg-type]
    return Request(f"r{i}", [1, 2, 3], resolved, seed=i, arrival_seq=i, total_ut_steps=D)


def _state(seats: int = 8, **config: object) -> SchedulerState:
    cfg = SchedulerConfig(max_num_seqs=seats, num_blocks=64, **{**SHED, **config})  # type: ignore[arg-type]
    return SchedulerState(cfg, LIMITS, new_kv(cfg, LIMITS))


def _load(state: SchedulerState, waiting: int, running: int) -> None:
    """The queue as admission left it: ``waiting`` requests that could not start."""
    state.running = [_request(i) for i in range(running)]
    state.waiting = []
    for i in range(waiting):
        r = _request(100 + i)
        heapq.heappush(state.waiting, (r.priority_key, r))


def _steps(budget: DepthBudget, state: SchedulerState, n: int) -> list[int]:
    seen = []
    for _ in range(n):
        budget.update()
        state.next_seq += 1
        seen.append(state.depth_budget)
    return seen


@pytest.mark.unit
def test_a_long_queue_sheds_one_loop_per_dwell_down_to_the_floor() -> None:
    state = _state()
    budget = DepthBudget(state)
    _load(state, waiting=4, running=8)  # the queue holds half the running set
    seen = _steps(budget, state, 4 * SHED_DWELL_STEPS)
    assert seen[SHED_DWELL_STEPS - 2] == D and seen[SHED_DWELL_STEPS - 1] == D - 1
    assert seen[2 * SHED_DWELL_STEPS - 1] == D - 2
    assert seen[-1] == 2  # shed_min_loops: never lower
    changes = budget.take_changes()
    assert [(c.old, c.new) for c in changes] == [(4, 3), (3, 2)]
    assert changes[0].batch_seq == SHED_DWELL_STEPS - 1 and changes[0].waiting == 4


@pytest.mark.unit
def test_a_look_without_a_batch_built_does_not_count_toward_the_dwell() -> None:
    state = _state()
    budget = DepthBudget(state)
    _load(state, waiting=4, running=8)
    for _ in range(SHED_DWELL_STEPS - 1):
        for _ in range(5):  # the engine asks again while its rows are in flight
            budget.update()
        state.next_seq += 1
    assert state.depth_budget == D
    budget.update()
    assert state.depth_budget == D - 1


@pytest.mark.unit
def test_the_budget_holds_in_the_band_and_rises_only_when_it_would_fit() -> None:
    state = _state(seats=8)
    budget = DepthBudget(state)
    state.depth_budget = 2
    # a short queue (below the high mark): hold
    _load(state, waiting=1, running=8)
    assert set(_steps(budget, state, 3 * RESTORE_DWELL_STEPS)) == {2}
    # no queue, but 6 of 8 seats at budget 2 would be 9 at 3: still hold
    _load(state, waiting=0, running=6)
    assert set(_steps(budget, state, 3 * RESTORE_DWELL_STEPS)) == {2}
    # 4 of 8 at budget 2 is 6 at 3 (<= 0.9 x 8): one loop up per restore dwell
    _load(state, waiting=0, running=4)
    seen = _steps(budget, state, RESTORE_DWELL_STEPS)
    assert seen[-2:] == [2, 3]
    # 4 at 3 would be 5.3 at 4: up again after another dwell
    assert _steps(budget, state, RESTORE_DWELL_STEPS)[-1] == 4
    assert [(c.old, c.new) for c in budget.take_changes()] == [(2, 3), (3, 4)]


@pytest.mark.unit
def test_an_empty_engine_goes_back_to_full_depth_at_once() -> None:
    state = _state()
    budget = DepthBudget(state)
    state.depth_budget = 2
    _load(state, waiting=0, running=0)
    assert _steps(budget, state, 1) == [D]


@pytest.mark.unit
@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_idle_engine_runs_the_next_request_at_full_depth(
    toy_model: OuroModel, asynchronous: bool
) -> None:
    """Through the engine: async scheduling ends most fills with a schedule() that builds
    nothing, which must not keep the empty engine's reset from happening."""
    config = SchedulerConfig(num_blocks=64, async_scheduling=asynchronous, **SHED)  # type: ignore[arg-type]
    engine = LLMEngine(toy_model, config)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.scheduler._state.depth_budget = 2  # as a past overload left it
    engine.add_request("first", [3, 4, 5], params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # idle: nothing to run
    assert engine.scheduler.depth_budget == D
    engine.add_request("next", [3, 4, 6], params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [e for e in engine.step() if isinstance(e, FinishedEvent)]
    (done,) = finished
    assert done.shed_tokens == 0


@pytest.mark.unit
def test_reject_never_moves_the_budget() -> None:
    state = _state(overload_policy="reject")
    budget = DepthBudget(state)
    _load(state, waiting=50, running=8)
    assert set(_steps(budget, state, 10 * SHED_DWELL_STEPS)) == {D}


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 8)), min_size=1, max_size=400))
@pytest.mark.unit
def test_the_budget_moves_one_loop_at_a_time_and_never_flaps(loads: list) -> None:
    """Whatever the queue does: the budget stays in [floor, D], moves by one loop, and two
    moves are at least a shed dwell apart (a change needs its condition held that long);
    going back up needs a restore dwell."""
    state = _state()
    budget = DepthBudget(state)
    for waiting, running in loads:
        _load(state, waiting, running)
        _steps(budget, state, 1)
    changes = budget.take_changes()
    for c in changes:
        assert 2 <= c.new <= D and (abs(c.new - c.old) == 1 or (c.new == D and c.running == 0))
    for a, b in itertools.pairwise(changes):
        assert b.batch_seq - a.batch_seq >= (1 if b.running == 0 else SHED_DWELL_STEPS)
        if b.new > a.new and b.running:
            assert b.batch_seq - a.batch_seq >= RESTORE_DWELL_STEPS


@pytest.mark.unit
def test_a_token_budget_respects_the_request() -> None:
    assert token_budget(_request(0), 2) == 2
    assert token_budget(_request(0, min_loops=3), 2) == 3  # its own min_loops wins
    assert token_budget(_request(0, min_loops=4), 2) is None  # min_loops = max_loops
    assert token_budget(_request(0, max_loops=2, min_loops=1), 2) is None  # asked for 2
    assert token_budget(_request(0, max_loops=3, min_loops=1), 2) == 2
    assert token_budget(_request(0, shed_depth=False), 2) is None
    assert token_budget(_request(0), D) is None


@pytest.mark.unit
def test_config_and_flags() -> None:
    config = SchedulerConfig(overload_policy="shed-depth", shed_min_loops=3, shed_queue_high=1.5)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    back = scheduler_config_from_args(parser.parse_args(engine_args(config)))
    assert dataclasses.asdict(back) == dataclasses.asdict(config)
    for bad in ({"overload_policy": "drop"}, {"shed_min_loops": 0}, {"shed_queue_high": 0.0}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="shed_depth"):
        SamplingParams(shed_depth=1).validate()  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the worker
def _row(depth: int, max_loops: int | None, kind: RowKind = RowKind.DECODE) -> BatchRow:
    return BatchRow(
        request_id="a", kind=kind, token_start=5, token_count=1, depth=depth, max_loops=max_loops
    )


@pytest.mark.unit
def test_a_follow_on_gives_its_budget_only_to_a_new_token() -> None:
    def resolve(cursor_row: BatchRow, follow_on_budget: int | None) -> BatchRow:
        batch = Batch(
            seq=1, kind=BatchKind.RECURRENT, rows=[_row(0, follow_on_budget, RowKind.FOLLOW_ON)]
        )
        (live,) = live_rows(batch, {"a": RowCursor(next_decode=cursor_row)})
        return live.row

    assert resolve(_row(0, None), 2).max_loops == 2  # the token's first loop: the new budget
    assert resolve(_row(0, 3), None).max_loops is None
    assert resolve(_row(2, 3), 2).max_loops == 3  # a later loop keeps its token's budget
    assert resolve(_row(1, None), 2).max_loops is None


@pytest.mark.unit
def test_the_simulated_device_caps_its_exits_at_the_budget(toy_model: OuroModel) -> None:
    sim = SimRunner.h200(toy_model.cfg)
    s = WorkerSampling(
        temperature=0.0, top_p=1.0, top_k=0, seed=7, min_loops=1, max_loops=D, exit_threshold=0.5
    )
    for position in range(40):
        natural = sim.exit_loops_at(s, position)
        assert sim.exit_loops_at(s, position, None) == natural
        assert sim.exit_loops_at(s, position, 2) == min(natural, 2)


# ---------------------------------------------------------------------- exactness
def _workload(n: int, seed: int, *, max_tokens: int = 14, step_gap: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = []
    for i in range(n):
        policy = [
            {},  # fixed depth, min_loops 2
            {"min_loops": 1, "exit_threshold": 0.7},
            {"min_loops": 3},  # its min_loops stops shedding at 3
            {"min_loops": 1, "max_loops": 3, "exit_threshold": 0.8},
        ][i % 4]
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, shed_depth=i % 5 != 4, **policy
        )  # type: ignore[arg-type]
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 14))]
        arrivals.append(Arrival(f"r{i}", prompt, params, step=i * step_gap))
    return arrivals


def _oracle_with_budgets(
    oracle: SerialOracle, a: Arrival, f: FinishedEvent, layout: KVLayout, chunk: int
) -> object:
    p = a.params
    return oracle.generate(
        a.prompt,
        max_tokens=p.max_tokens,
        min_loops=p.min_loops,
        max_loops=p.max_loops,
        exit_threshold=p.exit_threshold,
        ignore_eos=True,
        kv_layout=layout.value,
        prefill_chunk_size=chunk if layout is KVLayout.SHARED else None,
        max_loops_per_token=f.depth_budgets,
    )


OVERLOADED = {
    "async": {},
    "sync": {"async_scheduling": False},
    "atomic-shared": {"kv_layout": KVLayout.SHARED, "split_prefill": False},
    "preempting": {"kv_admission": KVAdmission.INCREMENTAL, "num_blocks": 40},
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", list(OVERLOADED))
def test_every_shed_token_equals_the_oracle_with_its_budget(
    name: str, toy_model: OuroModel, oracle: SerialOracle
) -> None:
    """Ten requests on two seats: the queue sheds depth. Each finished request equals the
    oracle run with its recorded per-token budgets, no budget goes below a request's
    min_loops, requests that refused shedding run at their own depth, and KV comes back."""
    base = {
        "max_num_seqs": 2,
        "block_size": 4,
        "num_blocks": 512,
        "prefill_chunk_size": 4,
        "max_num_batched_tokens": 16,
        **SHED,
    }
    config = SchedulerConfig(**{**base, **OVERLOADED[name]})  # type: ignore[arg-type]
    arrivals = _workload(10, seed=5)
    record = run_workload(toy_model, config, arrivals)
    assert record.engine is not None
    stats = record.engine.scheduler.stats
    assert stats.num_shed_tokens > 0
    if name == "preempting":
        assert stats.num_preemptions > 0
    shed = 0
    for a in arrivals:
        f = record.finished[a.request_id]
        expected = _oracle_with_budgets(oracle, a, f, config.kv_layout, config.prefill_chunk_size)
        assert_matches_oracle(f, expected, label=f"{name}/{a.request_id}")
        assert len(f.token_ids) == a.params.max_tokens
        if not a.params.shed_depth:
            assert f.shed_tokens == 0 and f.depth_budgets is None, a.request_id
        if f.depth_budgets is not None:
            assert len(f.depth_budgets) == len(f.token_ids)
            assert all(b >= a.params.min_loops for b in f.depth_budgets)
            shed += f.shed_tokens
            assert f.shed_tokens == sum(b < (a.params.max_loops or D) for b in f.depth_budgets)
            # a budget caps the exit: no token ran past its own
            assert all(e <= b for e, b in zip(f.exit_depths[1:], f.depth_budgets[1:], strict=True))
    assert shed == stats.num_shed_tokens


@pytest.mark.oracle
def test_padded_decode_passes_shed_exactly(toy_model: OuroModel, oracle: SerialOracle) -> None:
    """The static padded decode path (what a CUDA graph replays) reads the per-row budget."""
    config = SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=512, **SHED)  # type: ignore[arg-type]
    arrivals = _workload(8, seed=9)
    engine = LLMEngine(toy_model, config, decode_mode=DecodeMode.PADDED)
    finished = engine.generate([a.prompt for a in arrivals], [a.params for a in arrivals])
    assert engine.scheduler.stats.num_shed_tokens > 0
    for a, f in zip(arrivals, finished, strict=True):
        expected = _oracle_with_budgets(oracle, a, f, KVLayout.LAST_EXITED, 0)
        assert_matches_oracle(f, expected, label=a.request_id)


@pytest.mark.oracle
@pytest.mark.parametrize("asynchronous", [True, False])
def test_under_capacity_the_policy_changes_nothing(
    asynchronous: bool, toy_model: OuroModel
) -> None:
    """Arrivals spread out on enough seats: no queue forms, so shed-depth produces exactly
    the tokens and exit depths of reject, and no token is shed."""
    arrivals = _workload(10, seed=11, step_gap=6)
    runs = {}
    for policy in ("reject", "shed-depth"):
        config = SchedulerConfig(
            max_num_seqs=8,
            block_size=4,
            num_blocks=512,
            async_scheduling=asynchronous,
            overload_policy=policy,
        )  # type: ignore[arg-type]
        record = run_workload(toy_model, config, arrivals)
        runs[policy] = {
            rid: (f.token_ids, f.exit_depths, f.shed_tokens) for rid, f in record.finished.items()
        }
    assert runs["reject"] == runs["shed-depth"]
    assert all(shed == 0 for _, _, shed in runs["shed-depth"].values())


@pytest.mark.unit
def test_budget_is_visible_in_metrics_and_batches(toy_model: OuroModel) -> None:
    config = SchedulerConfig(max_num_seqs=1, block_size=4, num_blocks=256, **SHED)  # type: ignore[arg-type]
    seen: list[tuple[int, list[int | None]]] = []
    engine = LLMEngine(
        toy_model,
        config,
        on_batch=lambda b: seen.append((b.depth_budget, [t.loop_budget for t in b.tasks])),
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [3, 4, 5 + i], params)
    telemetry = SchedulerTelemetry(lambda: engine.scheduler, total_ut_steps=D, prefix_caching=False)

    def metric(name: str) -> float:
        text = generate_latest(telemetry.registry).decode()
        (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
        return float(line.split()[-1])

    assert metric("rlt:depth_budget") == D
    shed_seen = min_budget = None
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.depth_budget < D and shed_seen is None:
            shed_seen = metric("rlt:depth_budget")
        min_budget = min(min_budget or D, engine.scheduler.depth_budget)
    assert shed_seen is not None and shed_seen < D and min_budget == 2
    assert metric("rlt:shed_tokens_total") == engine.scheduler.stats.num_shed_tokens > 0
    assert {b for b, _ in seen} >= {2, 3, 4}
    # a lowered budget reaches the rows of the tokens that start under it
    assert any(lb == 2 for b, rows in seen if b == 2 for lb in rows)


# ---------------------------------------------------------------------- the HTTP API
@pytest.mark.unit
def test_http_shed_depth_field_and_usage() -> None:
    from services.gateway.protocol import parse_completion
    from services.gateway.stream import Answer, combined_usage
    from services.gateway.translate import Options, to_generate

    body = b'{"prompt": "hi", "shed_depth": false}'
    assert to_generate(parse_completion(body), "r").shed_depth is False
    assert to_generate(parse_completion(b'{"prompt": "hi"}'), "r").shed_depth is True
    answers = []
    for i, shed in enumerate((3, 2)):
        a = Answer(
            f"r-{i}",
            Options(
                stream=False,
                include_usage=False,
                stops=(),
                include_stop_str=False,
                return_token_ids=False,
            ),
        )
        a.on_event(
            FinishedEvent(
                request_id=f"r-{i}",
                finish_reason="length",
                token_ids=[1] * 4,
                exit_depths=[4, 2, 2, 2],
                num_prompt_tokens=3,
                shed_tokens=shed,
                depth_budgets=[4, 2, 2, 2],
            )
        )
        answers.append(a)
    assert answers[0].usage().body()["shed_tokens"] == 3
    assert combined_usage(answers).body()["shed_tokens"] == 5
