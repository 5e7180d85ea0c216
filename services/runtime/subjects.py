"""Every NATS subject the system uses, in one place. Versioned so v2 can run beside v1.

Public subjects carry JSON (any NATS client or the ``nats`` CLI can use them); internal
subjects carry msgpack (smaller and faster to encode for batches and results).
"""

from __future__ import annotations

VERSION_PREFIX = "rlt.v1"

# public (JSON)
GENERATE = f"{VERSION_PREFIX}.generate"
ABORT = f"{VERSION_PREFIX}.abort"

# admission -> scheduler (msgpack)
SCHED_SUBMIT = f"{VERSION_PREFIX}.sched.submit"
SCHED_ABORT = f"{VERSION_PREFIX}.sched.abort"
# scheduler -> admission: queue depth for backpressure (msgpack)
SCHED_LOAD = f"{VERSION_PREFIX}.sched.load"
# admission -> scheduler request/reply: "are you there, and how loaded?" (when reports stop)
SCHED_LOAD_GET = f"{VERSION_PREFIX}.sched.load.get"

# scheduler <-> worker (msgpack)
WORKER_BATCH = f"{VERSION_PREFIX}.worker.batch"
WORKER_RESULT = f"{VERSION_PREFIX}.worker.result"


def worker_result(epoch: str) -> str:
    """Reply subject of one scheduler epoch's batches (``<instance>.<generation>``). Being
    the batch's reply subject, it also receives nats-server's "no responders" status when no
    worker is subscribed, and the epoch in the subject says which batches it was about."""
    return f"{WORKER_RESULT}.{epoch}"


def worker_results_of(instance: str) -> str:
    """Wildcard over every epoch of one scheduler instance."""
    return f"{WORKER_RESULT}.{instance}.*"


# prefix cache (msgpack)
PREFIX_EVENTS = f"{VERSION_PREFIX}.prefix.events"
PREFIX_LOOKUP = f"{VERSION_PREFIX}.prefix.lookup"
PREFIX_REPLAY_PREFIX = f"{VERSION_PREFIX}.prefix.replay"


def prefix_replay(producer_id: str) -> str:
    """Where the prefix cache asks one producer (a scheduler) to resend events."""
    return f"{PREFIX_REPLAY_PREFIX}.{producer_id}"


def health(service: str) -> str:
    """Per-service JSON health endpoint (``nats req rlt.v1.health.scheduler ''``)."""
    return f"{VERSION_PREFIX}.health.{service}"


# service names as `rlt service NAME` takes them; the NATS micro name is "rlt-" + NAME
SERVICE_NAMES = ("admission", "scheduler", "worker", "prefix-cache")


def micro_name(service: str) -> str:
    return f"rlt-{service}"
