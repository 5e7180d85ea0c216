"""The worker's job runner: jobs run in submission order, short CPU batches on the event loop,
the others on the compute thread; the estimate that decides which; and the worker's
answers staying in seq order (no NATS)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from messages.batch import Batch, BatchKind, BatchResult, NewRequest, WorkerSampling
from messages.internal import WorkerBatch
from messages.sampling import StructuredOutput
from services.common.config import SchedulerConfig
from services.worker.batch_queue import BatchRun
from services.worker.compute import ExecuteTimeEstimate, JobRunner
from services.worker.service import WorkerService

pytestmark = pytest.mark.unit


class _Recorder:
    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []  # (job, thread name) in start order
        self.done: list[tuple[str, Any]] = []
        self.all_done = asyncio.Event()
        self.expected = 0
        self._running = 0
        self.max_running = 0  # jobs that ran at the same time: must stay 1
        self._lock = threading.Lock()

    def work(self, name: Any, seconds: float = 0.0, fail: bool = False) -> Any:
        def run() -> str:
            with self._lock:
                self._running += 1
                self.max_running = max(self.max_running, self._running)
            self.started.append((name, threading.current_thread().name))
            time.sleep(seconds)  # sleep(0) too: lets another thread in, should one run
            with self._lock:
                self._running -= 1
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
    assert rec.max_running == 1


async def test_jobs_submitted_at_random_moments_never_overlap_nor_reorder() -> None:
    """Submissions race the runner: from the loop between jobs, from ``done`` callbacks
    (as the worker queues the next batch when a result goes out), while a thread job ends."""
    rng = random.Random(7)
    rec = _Recorder()
    total = 300
    rec.expected = total
    runner: JobRunner
    submitted = 0

    def submit_one() -> None:
        nonlocal submitted
        inline = rng.random() < 0.5
        seconds = rng.choice([0.0, 0.0, 0.0005, 0.002])
        runner.submit(submitted, rec.work(submitted, seconds), inline=inline)
        submitted += 1

    def finished(job: Any, outcome: Any, elapsed: float) -> None:
        rec.finished(job, outcome, elapsed)
        while submitted < total and rng.random() < 0.4:
            submit_one()

    runner = JobRunner(asyncio.get_running_loop(), finished, name="test-compute")
    runner.start()
    while submitted < total:
        submit_one()
        await asyncio.sleep(rng.choice([0, 0, 0.001]))
    await asyncio.wait_for(rec.all_done.wait(), 30)
    await asyncio.to_thread(runner.stop)
    assert [n for n, _ in rec.started] == list(range(total))
    assert [job for job, _ in rec.done] == list(range(total))
    assert rec.max_running == 1
    assert runner.num_inline > 50 and runner.num_threaded > 50 and runner.idle


async def test_a_done_callback_that_raises_does_not_stop_the_runner() -> None:
    rec = _Recorder()
    rec.expected = 3
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    def finished(job: Any, outcome: Any, elapsed: float) -> None:
        rec.finished(job, outcome, elapsed)
        if job == "a":
            raise RuntimeError("bug in done")

    runner = JobRunner(loop, finished, name="test-compute")
    runner.start()
    try:
        runner.submit("a", rec.work("a"), inline=True)
        runner.submit("b", rec.work("b"), inline=True)
        runner.submit("c", rec.work("c"))
        await asyncio.wait_for(rec.all_done.wait(), 10)
    finally:
        loop.set_exception_handler(None)
        await asyncio.to_thread(runner.stop)
    assert [job for job, _ in rec.done] == ["a", "b", "c"] and runner.idle
    assert any(isinstance(c.get("exception"), RuntimeError) for c in reported)


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
    est = ExecuteTimeEstimate(smoothing=0.5, min_samples=2)
    assert est.estimate(100) is None
    est.observe(100, 0.001)  # 10 us per token-loop
    assert est.estimate(100) is None  # one batch is not enough to trust
    est.observe(100, 0.001)
    assert est.estimate(200) == pytest.approx(0.002)
    est.observe(100, 0.003)  # rate 30 us: halfway there
    assert est.estimate(100) == pytest.approx(0.002)
    est.observe(0, 5.0)  # an empty batch teaches nothing
    assert est.estimate(100) == pytest.approx(0.002)


async def test_worker_answers_a_refused_batch_behind_the_batches_queued_before_it(
    toy_checkpoint: Path,
) -> None:
    """A batch whose KV geometry the worker refuses is answered in seq order: its error must
    not overtake the result of a batch still running (the scheduler applies results in
    order). No NATS: the worker's queueing, run and result path only."""
    config = SchedulerConfig(block_size=4, num_blocks=64)
    worker = WorkerService("nats://127.0.0.1:1", toy_checkpoint, config, inline_max_s=0.0)
    await worker.setup()
    try:
        assert worker.runner is not None
        execute = worker.runner.execute

        def slow(batch: Batch) -> BatchResult:
            time.sleep(0.2)  # seq 0 still runs when seq 1 is refused
            return execute(batch)

        worker.runner.execute = slow  # type: ignore[method-assign]
        worker.queue.epoch = "sched.1"
        for seq, num_blocks in ((0, 64), (1, -1)):
            wb = WorkerBatch(
                epoch="sched.1",
                batch=Batch(seq=seq, kind=BatchKind.RECURRENT, rows=[]),
                num_blocks=num_blocks,
                block_size=4,
                kv_layout=str(config.kv_layout),
            )
            worker.queue.pending[seq] = BatchRun(wb, "reply", time.perf_counter())
        worker.queue.release()
        answers = [await asyncio.wait_for(worker.queue.results.get(), 10) for _ in range(2)]
    finally:
        await worker.teardown()
    assert [run.wb.batch.seq for run, _, _ in answers] == [0, 1]
    assert answers[0][1].error is None
    assert answers[1][1].error is not None and "geometry" in answers[1][1].error


async def test_a_failed_kv_reset_is_retried_by_the_next_batch(toy_checkpoint: Path) -> None:
    """A KV reset that fails (out of memory mid-allocation) leaves no runner: the batches
    queued behind it fail with a clear error, and the next batch queued resets again."""
    config = SchedulerConfig(block_size=4, num_blocks=64)
    worker = WorkerService("nats://127.0.0.1:1", toy_checkpoint, config, inline_max_s=0.0)
    await worker.setup()
    host = worker.runner_host
    make_runner = host.make_runner
    failures = [MemoryError("CUDA out of memory (simulated)")]

    def flaky(*geometry: object) -> None:
        if failures:
            host.runner = None  # as the real reset does before it allocates
            raise failures.pop()
        make_runner(*geometry)  # type: ignore[arg-type]

    host.make_runner = flaky  # type: ignore[method-assign]
    worker.queue.epoch = "sched.1"

    async def run(seq: int) -> BatchResult:
        wb = WorkerBatch(
            epoch="sched.1",
            batch=Batch(seq=seq, kind=BatchKind.RECURRENT, rows=[]),
            num_blocks=32,  # a new geometry: a reset first
            block_size=4,
            kv_layout=str(config.kv_layout),
        )
        worker.queue.pending[seq] = BatchRun(wb, "reply", time.perf_counter())
        worker.queue.release()
        _, result, _ = await asyncio.wait_for(worker.queue.results.get(), 10)
        return result

    try:
        failed = await run(0)
        assert failed.error is not None and "KV reset failed" in failed.error
        ok = await run(1)
        assert ok.error is None and worker.runner is not None
        assert worker.runner.k_cache.shape[1:3] == (33, 4)  # the new geometry, and a scratch block
    finally:
        await worker.teardown()


async def test_a_batch_that_may_wait_for_a_grammar_never_runs_on_the_event_loop(
    toy_checkpoint: Path,
) -> None:
    """A pass that waits for a grammar to compile (seconds on a busy CPU, xgrammar's import
    first) must not run on the event loop: the worker's heartbeats would stop and its
    scheduler would give it up."""
    config = SchedulerConfig(block_size=4, num_blocks=64)
    worker = WorkerService("nats://127.0.0.1:1", toy_checkpoint, config, inline_max_s=0.05)
    await worker.setup()
    try:
        queue, book = worker.queue, worker.runner_host.grammars
        assert book is not None
        for _ in range(5):
            queue.execute_time.observe(10, 0.0001)

        def run(new: list[NewRequest]) -> BatchRun:
            wb = WorkerBatch(
                epoch="e", batch=Batch(seq=0, kind=BatchKind.RECURRENT, rows=[], new_requests=new)
            )
            return BatchRun(wb, "reply", time.perf_counter())

        fmt = StructuredOutput(kind="regex", spec="[a-c]{2}")
        sampling = WorkerSampling(
            temperature=0.0, top_p=1.0, top_k=0, seed=1, min_loops=1, max_loops=4,
            exit_threshold=1.0, structured_output=fmt,
        )  # fmt: skip
        assert queue._inline(run([]))
        assert not queue._inline(
            run([NewRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sampling)])
        )
        gate = threading.Event()
        book._pool.submit(gate.wait)  # the compile below waits behind this
        compiled = book.compile(fmt)
        assert book.compiling and not queue._inline(run([]))
        gate.set()
        await asyncio.wrap_future(compiled)
        assert not book.compiling and queue._inline(run([]))
    finally:
        await worker.teardown()
