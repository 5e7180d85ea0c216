"""The worker's job runner: jobs run in submission order, short CPU batches on the event loop,
the others on the compute thread; and the estimate that decides which (no NATS)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from services.worker.compute import ExecuteTimeEstimate, JobRunner

pytestmark = pytest.mark.unit


class _Recorder:
    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []  # (job, thread name) in start order
        self.done: list[tuple[str, Any]] = []
        self.all_done = asyncio.Event()
        self.expected = 0

    def work(self, name: str, seconds: float = 0.0, fail: bool = False) -> Any:
        def run() -> str:
            self.started.append((name, threading.current_thread().name))
            if seconds:
                time.sleep(seconds)
            if fail:
                raise ValueError(f"{name} failed")
            return f"{name} ok"

        return run

    def finished(self, job: Any, outcome: Any, elapsed: float) -> None:
        assert elapsed >= 0.0
        self.done.append((job, outcome))
        if len(self.done) == self.expected:
            self.all_done.set()


async def _run_jobs(jobs: list[tuple[str, bool, float]]) -> tuple[_Recorder, JobRunner]:
    rec = _Recorder()
    rec.expected = len(jobs)
    runner = JobRunner(asyncio.get_running_loop(), rec.finished, name="test-compute")
    runner.start()
    try:
        for name, inline, seconds in jobs:
            runner.submit(name, rec.work(name, seconds), inline=inline)
        await asyncio.wait_for(rec.all_done.wait(), 10)
        assert runner.idle and runner.queued == 0
    finally:
        await asyncio.to_thread(runner.stop)
    return rec, runner


async def test_mixed_jobs_run_in_order_each_where_it_was_sent() -> None:
    # a slow thread job first: the inline jobs behind it must wait for it, not overtake it
    plan = [("a", False, 0.05), ("b", True, 0.0), ("c", True, 0.0), ("d", False, 0.0),
            ("e", False, 0.01), ("f", True, 0.0)]  # fmt: skip
    rec, runner = await _run_jobs(plan)
    names = [n for n, _ in rec.started]
    assert names == ["a", "b", "c", "d", "e", "f"]
    assert [job for job, _ in rec.done] == names
    loop_thread = threading.current_thread().name
    where = dict(rec.started)
    for name, inline, _ in plan:
        assert (where[name] == loop_thread) == inline, (name, where[name])
    assert (runner.num_inline, runner.num_threaded) == (3, 3)


async def test_a_failing_job_reports_its_exception_and_the_next_still_runs() -> None:
    rec = _Recorder()
    rec.expected = 3
    runner = JobRunner(asyncio.get_running_loop(), rec.finished, name="test-compute")
    runner.start()
    runner.submit("x", rec.work("x", fail=True), inline=True)
    runner.submit("y", rec.work("y", fail=True))
    runner.submit("z", rec.work("z"), inline=True)
    await asyncio.wait_for(rec.all_done.wait(), 10)
    await asyncio.to_thread(runner.stop)
    outcomes = dict(rec.done)
    assert isinstance(outcomes["x"], ValueError) and isinstance(outcomes["y"], ValueError)
    assert outcomes["z"] == "z ok"


async def test_the_loop_keeps_serving_while_a_thread_job_runs() -> None:
    rec = _Recorder()
    rec.expected = 1
    runner = JobRunner(asyncio.get_running_loop(), rec.finished, name="test-compute")
    runner.start()
    runner.submit("long", rec.work("long", 0.3))
    ticks = 0
    while not rec.all_done.is_set():
        await asyncio.sleep(0.01)
        ticks += 1
        if ticks == 5:
            assert runner.running_since > 0  # busy, as the heartbeat reports it
    await asyncio.to_thread(runner.stop)
    assert ticks >= 10  # heartbeats and health answers go on during a long batch
    assert runner.running_since == 0.0


def test_estimate_follows_the_measured_rate_and_knows_nothing_at_first() -> None:
    est = ExecuteTimeEstimate(smoothing=0.5)
    assert est.estimate(100) is None
    est.observe(100, 0.001)  # 10 us per token-loop
    assert est.estimate(200) == pytest.approx(0.002)
    est.observe(100, 0.003)  # rate 30 us: halfway there
    assert est.estimate(100) == pytest.approx(0.002)
    est.observe(0, 5.0)  # an empty batch teaches nothing
    assert est.estimate(100) == pytest.approx(0.002)
