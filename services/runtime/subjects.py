"""Every NATS subject the system uses, in one place. Versioned so v2 can run beside v1.

Public subjects carry JSON (any NATS client or the ``nats`` CLI can use them); internal
subjects carry msgpack (smaller and faster to encode for batches and results).
"""

from __future__ import annotations

VERSION_PREFIX = "rlt.v1"

# public (JSON)
GENERATE = f"{VERSION_PREFIX}.generate"
ABORT = f"{VERSION_PREFIX}.abort"

# admission -> scheduler (msgpack): per shard (``sched_submit(shard)``); SCHED_ABORT reaches
# every shard (an abort for a request this admission did not route)
SCHED_SUBMIT = f"{VERSION_PREFIX}.sched.submit"
SCHED_ABORT = f"{VERSION_PREFIX}.sched.abort"
# scheduler -> admission: queue depth for backpressure (msgpack)
SCHED_LOAD = f"{VERSION_PREFIX}.sched.load"
# admission -> scheduler request/reply: "are you there, and how loaded?" (when reports stop)
SCHED_LOAD_GET = f"{VERSION_PREFIX}.sched.load.get"

# shards (msgpack): a scheduler announces its shard on start and when a router asks
SHARD_ANNOUNCE = f"{VERSION_PREFIX}.shard.announce"
SHARD_DISCOVER = f"{VERSION_PREFIX}.shard.discover"
# the shard that runs when none is named (``rlt service scheduler`` without ``--shard``)
DEFAULT_SHARD = "0"
_SHARD_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def check_shard_id(shard_id: str) -> str:
    """A shard id is a short string usable as one NATS subject token; returns it."""
    if not 1 <= len(shard_id) <= 32 or not set(shard_id) <= _SHARD_ID_CHARS:
        raise ValueError(f"shard id must be 1-32 characters of [A-Za-z0-9_-], got {shard_id!r}")
    return shard_id


def sched_submit(shard_id: str) -> str:
    return f"{SCHED_SUBMIT}.{shard_id}"


def sched_abort(shard_id: str) -> str:
    return f"{SCHED_ABORT}.{shard_id}"


# scheduler <-> worker (msgpack)
WORKER_BATCH = f"{VERSION_PREFIX}.worker.batch"
WORKER_RESULT = f"{VERSION_PREFIX}.worker.result"
# worker -> schedulers: liveness and progress (WorkerHeartbeat); schedulers -> workers: "say
# hello now" (a fresh scheduler need not wait a heartbeat interval for its first worker)
WORKER_HEARTBEAT = f"{VERSION_PREFIX}.worker.heartbeat"
WORKER_DISCOVER = f"{VERSION_PREFIX}.worker.discover"


def worker_heartbeat(shard_id: str) -> str:
    """One shard's workers' heartbeats: only that shard's scheduler binds them."""
    return f"{WORKER_HEARTBEAT}.{shard_id}"


def worker_discover(shard_id: str) -> str:
    return f"{WORKER_DISCOVER}.{shard_id}"


def worker_batch(worker_id: str) -> str:
    """Batches go to ONE worker instance: its device KV mirrors one scheduler's block tables,
    so a queue group spreading batches over replicas would corrupt it. Other workers stand by."""
    return f"{WORKER_BATCH}.{worker_id}"


def worker_result(epoch: str) -> str:
    """Reply subject of one scheduler epoch's batches (``<instance>.<generation>``). Being
    the batch's reply subject, it also receives nats-server's "no responders" status when no
    worker is subscribed, and the epoch in the subject says which batches it was about."""
    return f"{WORKER_RESULT}.{epoch}"


def worker_results_of(instance: str) -> str:
    """Wildcard over every epoch of one scheduler instance."""
    return f"{WORKER_RESULT}.{instance}.*"


# scheduler -> scheduler itself: reply subject of stream events. nats-server answers a
# publish whose destination has no subscriber (a client that went away) with a "no responders"
# status on the reply subject, naming the stream; the scheduler then aborts it and frees its KV
def stream_gone(scheduler_id: str, stream_no: int) -> str:
    return f"{VERSION_PREFIX}.sched.gone.{scheduler_id}.{stream_no}"


def streams_gone_of(scheduler_id: str) -> str:
    return f"{VERSION_PREFIX}.sched.gone.{scheduler_id}.*"


# admission <- scheduler: per-request tracking subject (the submit's reply subject) that
# receives RequestNotice ("accepted" / "done") and, when no scheduler listens, the "no
# responders" status for the submit itself
ADMISSION_TRACK_PREFIX = f"{VERSION_PREFIX}.adm"


def admission_track(admission_id: str, seq: int) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.{seq}"


def admission_tracks_of(admission_id: str) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.*"


# scheduler -> admission: the events of the streams admission relays (RelayBatch, msgpack),
# one subject per admission so they arrive in the order the scheduler published them
def admission_relay(admission_id: str) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.relay.events"


# admission -> admission: reply subject of relayed client events; nats-server answers it with
# "no responders" when the client is gone, and admission aborts the request at its shard
def client_gone(admission_id: str, seq: int) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.gone.{seq}"


def clients_gone_of(admission_id: str) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.gone.*"


# prefix cache (msgpack). Events go to the JetStream stream RLT_PREFIX_EVENTS (see
# services/runtime/jetstream.py), one subject per producer; lookups are core request/reply
PREFIX_EVENTS = f"{VERSION_PREFIX}.prefix.events"
PREFIX_EVENTS_ALL = f"{PREFIX_EVENTS}.>"
PREFIX_LOOKUP = f"{VERSION_PREFIX}.prefix.lookup"


def prefix_events(producer_id: str) -> str:
    """The stream subject of one producer's events (a scheduler's RLT_SCHEDULER_NAME)."""
    if not producer_id or any(c in producer_id for c in ".*> \t\r\n"):
        raise ValueError(f"producer id {producer_id!r} is not a NATS subject token")
    return f"{PREFIX_EVENTS}.{producer_id}"


# services' own request inboxes live outside _INBOX, which clients may subscribe to: a client
# cannot read a service's replies, and the NATS config can scope each service to its own
SERVICE_INBOX_PREFIX = "_RLT_INBOX"


def service_inbox(connection_name: str) -> str:
    """Inbox prefix of one service's connection (``_RLT_INBOX.rlt-admission``)."""
    return f"{SERVICE_INBOX_PREFIX}.{connection_name}"


def health(service: str, shard_id: str | None = None) -> str:
    """Per-service JSON health endpoint (``nats req rlt.v1.health.scheduler ''``); with a
    shard, that shard's instance (``rlt.v1.health.scheduler.1``)."""
    base = f"{VERSION_PREFIX}.health.{service}"
    return base if shard_id is None else f"{base}.{shard_id}"


# service names as `rlt service NAME` takes them; the NATS micro name is "rlt-" + NAME
SERVICE_NAMES = ("admission", "scheduler", "worker", "prefix-cache")


def micro_name(service: str) -> str:
    return f"rlt-{service}"
