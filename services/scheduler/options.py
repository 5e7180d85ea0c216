"""The scheduler service's timeouts and names, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from services.common.config import scheduler_lost_s
from services.common.service_flags import SHARD_ROLES
from services.runtime import subjects


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass(frozen=True)
class SchedulerOptions:
    """Timeouts of the scheduler service (env names in ``from_env``; docs/services.md)."""

    # a batch not answered in this long: the worker is hung (declared lost, then suspect)
    batch_timeout_s: float = 300.0
    # no heartbeat for this long (while we were connected): the worker is dead
    heartbeat_timeout_s: float = 3.0
    # how long requests wait while no worker is up before they end with "unavailable"
    worker_wait_s: float = 60.0
    # a request older than this ends with "timeout" (abandoned or runaway streams)
    max_request_s: float = 3600.0
    # after a NATS reconnect, client events are held this long so clients can resubscribe
    reconnect_grace_s: float = 2.0
    # a batch/result a heartbeat says is missing must be this overdue before it counts lost
    loss_grace_s: float = 2.0
    load_interval_s: float = 0.25
    # the engine shard this scheduler drives (``--shard``): its subjects and its workers
    shard_id: str = subjects.DEFAULT_SHARD
    # prefix-event producer name, stable across restarts, one per shard ("" = from the
    # shard: ``scheduler-<shard>``; RLT_SCHEDULER_NAME overrides it)
    producer_name: str = ""
    # admission's RLT_SCHEDULER_LOST_S: after a dark spell shorter than this, no admission
    # can have ended our requests (used when an admission does not answer a fence query)
    scheduler_lost_s: float = field(default_factory=scheduler_lost_s)
    # how long an abort that came before its request is remembered
    abort_keep_s: float = 10.0
    # disaggregation: "prefill", "decode" or "both" (announced to admission)
    role: str = "both"
    # a handoff's blocks are freed after this without the decode side's release, and a
    # pull (decode side) fails after this long
    kv_handoff_hold_s: float = 30.0
    kv_transfer_timeout_s: float = 10.0

    @classmethod
    def from_env(cls, **overrides: Any) -> SchedulerOptions:
        base = cls(**overrides)
        return cls(
            batch_timeout_s=_env_float("RLT_BATCH_TIMEOUT_S", base.batch_timeout_s),
            heartbeat_timeout_s=_env_float(
                "RLT_WORKER_HEARTBEAT_TIMEOUT_S", base.heartbeat_timeout_s
            ),
            worker_wait_s=_env_float("RLT_WORKER_WAIT_S", base.worker_wait_s),
            max_request_s=_env_float("RLT_MAX_REQUEST_S", base.max_request_s),
            reconnect_grace_s=_env_float("RLT_RECONNECT_GRACE_S", base.reconnect_grace_s),
            loss_grace_s=base.loss_grace_s,
            load_interval_s=base.load_interval_s,
            shard_id=subjects.check_shard_id(base.shard_id),
            producer_name=os.environ.get("RLT_SCHEDULER_NAME") or base.producer_name,
            scheduler_lost_s=base.scheduler_lost_s,
            abort_keep_s=_env_float("RLT_ABORT_TOMBSTONE_S", base.abort_keep_s),
            role=check_role(base.role),
            kv_handoff_hold_s=_env_float("RLT_KV_HANDOFF_HOLD_S", base.kv_handoff_hold_s),
            kv_transfer_timeout_s=_env_float(
                "RLT_KV_TRANSFER_TIMEOUT_S", base.kv_transfer_timeout_s
            ),
        )

    @property
    def producer(self) -> str:
        return self.producer_name or f"scheduler-{self.shard_id}"


def check_role(role: str) -> str:
    if role not in SHARD_ROLES:
        raise ValueError(f"role must be one of {', '.join(SHARD_ROLES)}, got {role!r}")
    return role
