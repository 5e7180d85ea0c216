"""The worker's compute thread: runs jobs (batches, runner resets) one after another, off the
event loop, and hands each outcome back to the loop.

One long-lived thread fed by a queue, instead of a thread-pool call per batch: the batches
a scheduler keeps in flight are queued while the current one computes, so the thread goes
straight from one batch to the next without waiting for the event loop (a round trip
through the loop costs about 0.15 ms a batch on the CPU bench, a tenth of a toy pass).
The event loop meanwhile receives and decodes the next batches and publishes results.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_STOP = object()

Done = Callable[[Any, Any, float], None]  # (job, outcome, seconds it ran)


class ComputeThread:
    def __init__(self, loop: asyncio.AbstractEventLoop, done: Done, name: str) -> None:
        self._loop = loop
        self._done = done
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.running_since = 0.0  # monotonic start of the job running now; 0 when idle
        self.queued = 0  # jobs submitted and not yet done (the loop's own count)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Any, work: Callable[[], Any]) -> None:
        """Queues ``work``; its outcome reaches ``done(job, outcome, seconds)`` on the loop."""
        self.queued += 1
        self._jobs.put((job, work))

    @property
    def idle(self) -> bool:
        return self.queued == 0

    def stop(self, timeout: float = 30.0) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            job, work = item
            self.running_since = time.monotonic()
            t0 = time.perf_counter()
            try:
                outcome = work()
            except BaseException as exc:  # handed to the loop, which decides what it means
                outcome = exc
            elapsed = time.perf_counter() - t0
            self.running_since = 0.0
            try:
                self._loop.call_soon_threadsafe(self._finished, job, outcome, elapsed)
            except RuntimeError:  # the loop closed (shutdown): nobody waits for it
                return

    def _finished(self, job: Any, outcome: Any, elapsed: float) -> None:
        self.queued -= 1
        self._done(job, outcome, elapsed)
