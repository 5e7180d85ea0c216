"""Which worker the scheduler talks to, and when it is gone (pure: no NATS, no clock).

Workers announce themselves with ``WorkerHeartbeat`` every fraction of a second. The
scheduler binds its epoch to ONE worker (its device KV mirrors this scheduler's block
tables); the others stand by. A bound worker is lost when

- its heartbeats stopped for ``heartbeat_timeout_s`` of time the scheduler itself was
  connected (a NATS outage is nobody's death),
- nats-server says nobody subscribes to its batch subject any more (process gone),
- a batch ran past ``batch_timeout_s`` (hung: it is marked suspect and not picked again until
  a heartbeat shows it idle),
- it drains (graceful stop) and its batches in flight came back,
- or its heartbeat proves a batch or a result was lost on the way (``LossDetector``).

Every loss ends in one call: ``SchedulerDriver.worker_lost`` (a new epoch, and
``Scheduler.reset_after_worker_loss``: running requests are recomputed on the next worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from messages.internal import WorkerHeartbeat


@dataclass
class WorkerInfo:
    worker_id: str
    first_seen: float
    last_seen: float
    heartbeat: WorkerHeartbeat
    suspect: bool = False  # declared hung: not picked until it reports itself idle
    taken_until: float = 0.0  # it refused us (bound to another live scheduler) until then


@dataclass
class WorkerTracker:
    heartbeat_timeout_s: float = 3.0
    workers: dict[str, WorkerInfo] = field(default_factory=dict)

    def heartbeat(self, hb: WorkerHeartbeat, now: float) -> WorkerInfo:
        info = self.workers.get(hb.worker_id)
        if info is None:
            info = self.workers[hb.worker_id] = WorkerInfo(hb.worker_id, now, now, hb)
        info.last_seen = now
        info.heartbeat = hb
        if info.suspect and hb.busy_s == 0.0:
            info.suspect = False  # the hung batch ended after all: usable again
        return info

    def is_dead(self, worker_id: str, now: float, connected_since: float) -> bool:
        info = self.workers.get(worker_id)
        if info is None:
            return True
        # silence while we ourselves were cut off from NATS does not count
        return now - max(info.last_seen, connected_since) > self.heartbeat_timeout_s

    def eligible(self, worker_id: str, now: float, connected_since: float) -> bool:
        info = self.workers.get(worker_id)
        return (
            info is not None
            and not info.suspect
            and not info.heartbeat.draining
            and now >= info.taken_until
            and not self.is_dead(worker_id, now, connected_since)
        )

    def choose(self, current: str | None, now: float, connected_since: float) -> str | None:
        """Keeps ``current`` while it is eligible; else the longest-known eligible worker."""
        self.prune(now, connected_since)
        if current is not None and self.eligible(current, now, connected_since):
            return current
        candidates = [
            w for w in self.workers.values() if self.eligible(w.worker_id, now, connected_since)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.first_seen, w.worker_id)).worker_id

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def mark_suspect(self, worker_id: str) -> None:
        info = self.workers.get(worker_id)
        if info is not None:
            info.suspect = True

    def mark_taken(self, worker_id: str, until: float) -> None:
        info = self.workers.get(worker_id)
        if info is not None:
            info.taken_until = until

    def prune(self, now: float, connected_since: float) -> None:
        for wid in [w for w in self.workers if self.is_dead(w, now, connected_since)]:
            del self.workers[wid]


@dataclass
class LossDetector:
    """Reads the bound worker's heartbeats against the batches in flight.

    - the worker is idle waiting for a batch we sent more than ``grace_s`` ago, or still
      reports an older epoch: the batch was lost;
    - it waits for a batch older than everything in flight: its state diverged;
    - the worker's ``next_seq`` passed a batch whose result has not arrived ``grace_s`` after
      we first saw that: the result was lost.

    ``grace_s`` covers messages still on their way; a false alarm only costs a recompute.
    """

    grace_s: float = 2.0
    _done_seen: dict[tuple[str, int], float] = field(default_factory=dict)

    def check(
        self,
        hb: WorkerHeartbeat,
        epoch: str,
        inflight: Sequence[int],
        sent_at: dict[int, float],
        now: float,
    ) -> str | None:
        if not inflight:
            self._done_seen.clear()
            return None
        oldest = inflight[0]
        age = now - sent_at.get(oldest, now)
        if hb.epoch != epoch:
            if hb.busy_s == 0.0 and age > self.grace_s:
                return f"worker never received batch {oldest} (it reports epoch {hb.epoch!r})"
            return None
        if hb.missing_seq in inflight:
            missing_age = now - sent_at.get(hb.missing_seq, now)
            if missing_age > self.grace_s:
                return f"batch {hb.missing_seq} was lost on its way to the worker"
        elif 0 <= hb.missing_seq < oldest and age > self.grace_s:
            # it waits for a batch whose result we already applied: its state diverged
            # (e.g. a stray message reset it); only a new epoch brings it back in line
            return f"worker waits for batch {hb.missing_seq}, already done here"
        if hb.next_seq > oldest:
            key = (epoch, oldest)
            seen = self._done_seen.setdefault(key, now)
            if now - seen > self.grace_s:
                return f"the result of batch {oldest} was lost on its way back"
        # forget batches that are no longer in flight
        for key in [k for k in self._done_seen if k[0] != epoch or k[1] < oldest]:
            del self._done_seen[key]
        return None
