"""What the scheduler tells others about itself: the load report routers weigh
(``SchedulerLoad``) and the scheduling part of the health reply. Pure: no NATS."""

from __future__ import annotations

import time
from typing import Any

from messages.internal import SchedulerLoad
from messages.prefix import blocks_digest
from services.scheduler.core.request import RequestState
from services.scheduler.core.scheduler import Scheduler

# recent batch round trips (submit -> result) weigh this much in the load report's step time
_STEP_TIME_WEIGHT = 0.2
# an admission instance silent this long is dropped from the load reports (admission's own
# record of unconfirmed submissions expires after 10 s: unseen_expiry_s)
ADMISSION_FORGET_S = 600.0


class LoadReport:
    def __init__(self, instance: str, shard_id: str, producer_id: str) -> None:
        self.instance = instance
        self.shard_id = shard_id
        self.producer_id = producer_id
        # per admission instance, the newest admission seq it submitted here (reported, so
        # it knows what arrived), and when: an admission that sent nothing for
        # ADMISSION_FORGET_S is forgotten (restarts make new ones; reports must not grow)
        self.last_admission_seq: dict[str, int] = {}
        self.admission_heard: dict[str, float] = {}
        self.step_time_s = 0.0
        self._seq = 0

    def submitted(self, admission_id: str, admission_seq: int, now: float) -> None:
        seen = self.last_admission_seq.get(admission_id, 0)
        self.last_admission_seq[admission_id] = max(seen, admission_seq)
        self.admission_heard[admission_id] = now

    def round_trip(self, took: float) -> None:
        """A batch's round trip: the report's step time follows recent ones."""
        w = _STEP_TIME_WEIGHT if self.step_time_s else 1.0
        self.step_time_s = (1 - w) * self.step_time_s + w * took

    def forget_idle_admissions(self, now: float) -> None:
        """Admission instances that submitted nothing for ``ADMISSION_FORGET_S``: gone, or
        idle (their own record of what is unconfirmed expires well before)."""
        idle = [a for a, at in self.admission_heard.items() if now - at > ADMISSION_FORGET_S]
        for admission in idle:
            del self.admission_heard[admission]
            self.last_admission_seq.pop(admission, None)

    def report(
        self, s: Scheduler, *, has_worker: bool, draining: bool, simulated: bool
    ) -> SchedulerLoad:
        self.forget_idle_admissions(time.monotonic())
        waiting = [r for r in s.requests.values() if r.state is RequestState.WAITING]
        self._seq += 1
        kv = s.kv
        return SchedulerLoad(
            scheduler_id=self.instance,
            num_waiting=len(waiting),
            num_waiting_tokens=sum(r.num_prompt_tokens for r in waiting),
            num_running=len(s.running),
            last_admission_seq=dict(self.last_admission_seq),
            time=time.time(),
            shard_id=self.shard_id,
            producer_id=self.producer_id,
            report_seq=self._seq,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_active_blocks=(kv.num_blocks - kv.num_free_blocks) // kv.num_planes,
            num_waiting_prefill_tokens=s.num_prefill_tokens_due(),
            step_time_s=self.step_time_s,
            has_worker=has_worker,
            draining=draining,
            simulated=simulated,
        )


def scheduler_health(s: Scheduler) -> dict[str, Any]:
    """The scheduling core's part of the health reply."""
    cached = s.kv.cached_block_hashes()
    return {
        "live_requests": len(s.requests),
        "running": len(s.running),
        "batches": s.stats.num_batches,
        "free_kv_blocks": s.kv.num_free_blocks,
        "num_kv_blocks": s.kv.num_blocks,
        # the scheduler's own prefix table, to compare with the prefix index's view
        "prefix_epoch": s.prefix_log.epoch,
        "prefix_blocks": len(cached),
        "prefix_digest": blocks_digest(cached),
    }
