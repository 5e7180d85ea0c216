"""Which worker the scheduler service's batches go to: heartbeats come in, the bound worker
is judged (dead, draining, refusing us, hung, gone from the bus) and another one chosen
(``liveness.py`` holds the rules). Pure: the service passes the clock and how long it has
been connected; every loss goes through ``SchedulerDriver.worker_lost``.
"""

from __future__ import annotations

from typing import Any

from messages.internal import WorkerHeartbeat, WorkerResult
from services.runtime import subjects
from services.scheduler.driver.driver import SchedulerDriver
from services.scheduler.driver.liveness import LossDetector, WorkerTracker

# a worker that refused our batches (it serves another live scheduler) is left alone this long
_TAKEN_S = 2.0


class WorkerBinding:
    def __init__(
        self, driver: SchedulerDriver, *, heartbeat_timeout_s: float, loss_grace_s: float, log: Any
    ) -> None:
        self.driver = driver
        self.workers = WorkerTracker(heartbeat_timeout_s)
        self.loss = LossDetector(loss_grace_s)
        self.log = log
        self.no_worker_since: float | None = None  # since when none has been usable

    @property
    def has_worker(self) -> bool:
        return self.driver.worker_id is not None and self.no_worker_since is None

    def heartbeat(self, hb: WorkerHeartbeat, now: float) -> None:
        self.workers.heartbeat(hb, now)
        self.driver.check_worker(hb, self.loss, now)

    def refused(self, wr: WorkerResult, now: float) -> None:
        """The worker serves another scheduler that is still connected: try another (or
        this one again once it is free)."""
        d = self.driver
        if wr.epoch != d.epoch or wr.worker_id != d.worker_id:
            return
        self.workers.mark_taken(wr.worker_id, now + _TAKEN_S)
        d.worker_lost(f"worker {wr.worker_id} refused our batches: {wr.refused}")

    def gone(self, now: float, connected_since: float) -> None:
        """Nobody subscribes to the bound worker's batch subject: its process is gone."""
        d = self.driver
        if d.worker_id is not None:
            self.workers.forget(d.worker_id)
        d.worker_lost(f"no worker is serving {subjects.WORKER_BATCH}")
        self.bind(now, connected_since)  # another worker, or "no worker" in the report

    def check_hung(self, now: float, batch_timeout_s: float) -> None:
        """A batch unanswered for ``batch_timeout_s``: the worker is hung (and suspect)."""
        d = self.driver
        age = d.oldest_inflight_age(now)
        if age > batch_timeout_s and d.worker_id is not None:
            self.workers.mark_suspect(d.worker_id)
            d.worker_lost(f"worker did not answer batch {d.inflight[0].seq} in {age:.0f}s")

    def bind(self, now: float, connected_since: float) -> bool:
        """Judges the bound worker and binds one if needed; False when none is usable."""
        d = self.driver
        bound = d.worker_id
        if bound is not None:
            info = self.workers.workers.get(bound)
            if self.workers.is_dead(bound, now, connected_since):
                self.workers.forget(bound)
                timeout = self.workers.heartbeat_timeout_s
                d.worker_lost(f"worker {bound} sent no heartbeat for {timeout}s")
            elif info is not None and info.heartbeat.draining:
                if d.inflight:
                    return False  # let it finish what it has, then move on
                d.worker_lost(f"worker {bound} is draining")
        chosen = self.workers.choose(d.worker_id, now, connected_since)
        if chosen is None:
            if self.no_worker_since is None:
                self.no_worker_since = now
                # before any worker has been seen (a normal start) this is not a problem
                log = self.log.warning if d.streams or self.workers.workers else self.log.info
                log("no worker available; requests wait", streams=len(d.streams))
            return False
        self.no_worker_since = None
        d.bind(chosen)
        return True
