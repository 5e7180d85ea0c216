"""How the worker runs its jobs (batches, runner resets): one after another, in order, each
either on a compute thread or on the event loop itself, and hands each outcome back.

Where a job runs is a question of who holds the interpreter lock:

- A device pass (CUDA, the simulated device) spends its time waiting for the device with the
  lock released, so on a thread the event loop receives, decodes and publishes meanwhile.
- A CPU pass of a small model is mostly Python dispatching small kernels, lock held. On a
  thread the event loop's work is not overlapped but interleaved, and each interleaving
  hands the lock across cores twice. `rlt bench --size toy --only pipeline` (async, 2 cores,
  four runs each way, alternated): a batch took 1.36-1.44 ms on the loop against 1.59-2.08
  ms on a thread (1.17-1.30 ms in-process); docs/benchmarks/README.md, "Pipeline".

So a job runs on the loop when the worker expects it to be short (``inline_max_s``, from the
time per token-loop it measured) and on the thread otherwise. A long job still runs on the
thread, so heartbeats and health answers keep flowing during it (a scheduler would declare a
silent worker lost). After a job on the loop, the loop turns a few times before the next
one: the result is published and flushed, and the batches that arrived are read.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Done = Callable[[Any, Any, float], None]  # (job, outcome, seconds it ran)

# loop turns before a job on the loop: the last result to the publisher, the publisher's
# write to nats-py's flusher, the flusher's socket write (arrived batches are read meanwhile)
_TURNS_BEFORE_INLINE = 3
_STOP = object()


@dataclass
class _Job:
    job: Any
    work: Callable[[], Any]
    inline: bool


class JobRunner:
    """Runs jobs strictly in submission order, each on the loop or on the one compute thread.
    Consecutive thread jobs go straight from one to the next on the thread, without a trip
    through the loop (about 0.15 ms a batch on the CPU bench)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, done: Done, name: str) -> None:
        self._loop = loop
        self._done = done
        self._lock = threading.Lock()  # guards _jobs and _busy (the thread reads them too)
        self._jobs: deque[_Job] = deque()
        self._busy = False  # a job runs, or is on its way to its runner
        self._to_thread: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)
        self._stopped = False
        self._inline_tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak refs
        self.running_since = 0.0  # monotonic start of the job running now; 0 when idle
        self.queued = 0  # jobs submitted and not yet done (the loop's own count)
        self.num_inline = 0  # jobs that ran on the loop, and on the thread
        self.num_threaded = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Any, work: Callable[[], Any], *, inline: bool = False) -> None:
        """Queues ``work``; its outcome reaches ``done(job, outcome, seconds)`` on the loop.
        ``inline``: run it on the event loop (short CPU work), else on the compute thread."""
        self.queued += 1
        with self._lock:
            self._jobs.append(_Job(job, work, inline))
            if self._busy:
                return
            self._busy = True
            head = self._jobs.popleft()
        self._hand(head)

    @property
    def idle(self) -> bool:
        return self.queued == 0

    def stop(self, timeout: float = 30.0) -> None:
        """From any thread: no job starts after this; one running ends first."""
        self._stopped = True
        self._to_thread.put(_STOP)
        self._thread.join(timeout)

    def _hand(self, job: _Job) -> None:
        """On the loop: starts ``job`` on its runner."""
        if job.inline:
            self._start_inline(job)
        else:
            self._to_thread.put(job)

    def _start_inline(self, job: _Job) -> None:
        task = self._loop.create_task(self._run_inline(job))
        self._inline_tasks.add(task)
        task.add_done_callback(self._inline_tasks.discard)

    async def _run_inline(self, job: _Job) -> None:
        for _ in range(_TURNS_BEFORE_INLINE):
            await asyncio.sleep(0)
        if self._stopped:
            return
        self.num_inline += 1
        outcome, elapsed = self._execute(job)
        try:
            self._finished(job, outcome, elapsed)
        except Exception as exc:  # reported like a failed callback on the thread path
            self._loop.call_exception_handler(
                {"message": "job runner: done callback failed", "exception": exc}
            )
        nxt = self._next()  # whatever ``done`` did, the next job must run
        if nxt is not None:
            self._hand(nxt)

    def _thread_main(self) -> None:
        while (item := self._to_thread.get()) is not _STOP:
            job: _Job | None = item
            while job is not None and not self._stopped:  # thread jobs back to back
                self.num_threaded += 1
                outcome, elapsed = self._execute(job)
                try:
                    self._loop.call_soon_threadsafe(self._finished, job, outcome, elapsed)
                except RuntimeError:  # the loop closed (shutdown): nobody waits for it
                    return
                job = self._next()
                if job is not None and job.inline:
                    try:  # to the loop, after the result above
                        self._loop.call_soon_threadsafe(self._start_inline, job)
                    except RuntimeError:  # the loop closed in between (shutdown)
                        return
                    job = None

    def _next(self) -> _Job | None:
        with self._lock:
            if not self._jobs:
                self._busy = False
                return None
            return self._jobs.popleft()

    def _execute(self, job: _Job) -> tuple[Any, float]:
        self.running_since = time.monotonic()
        t0 = time.perf_counter()
        try:
            outcome = job.work()
        except BaseException as exc:  # handed to ``done``, which decides what it means
            outcome = exc
        elapsed = time.perf_counter() - t0
        self.running_since = 0.0
        return outcome, elapsed

    def _finished(self, job: _Job, outcome: Any, elapsed: float) -> None:
        self.queued -= 1
        self._done(job.job, outcome, elapsed)


class ExecuteTimeEstimate:
    """Seconds a batch will take, from the seconds per token-loop (a row's tokens times its
    loops) of the batches before it. Linear through zero: a pass's fixed cost makes the rate
    of small batches high, so a big batch is overestimated (sent to the thread), never the
    other way round by much."""

    def __init__(self, smoothing: float = 0.2, min_samples: int = 3) -> None:
        self.smoothing = smoothing
        self.min_samples = min_samples  # no estimate from fewer batches than this
        self.num_samples = 0
        self.seconds_per_token_loop: float | None = None  # None: nothing measured yet

    def observe(self, token_loops: int, seconds: float) -> None:
        if token_loops <= 0:
            return
        self.num_samples += 1
        rate = seconds / token_loops
        old = self.seconds_per_token_loop
        self.seconds_per_token_loop = rate if old is None else old + self.smoothing * (rate - old)

    def estimate(self, token_loops: int) -> float | None:
        rate = self.seconds_per_token_loop
        if rate is None or self.num_samples < self.min_samples:
            return None
        return rate * token_loops
