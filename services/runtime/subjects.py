"""Every NATS subject the system uses, in one place. Versioned so v2 can run beside v1.

Public subjects carry JSON (any NATS client or the ``nats`` CLI can use them); internal
subjects carry msgpack (smaller and faster to encode for batches and results).
"""

from __future__ import annotations

import re

VERSION_PREFIX = "rlt.v1"

# public (JSON): the default tenant's
GENERATE = f"{VERSION_PREFIX}.generate"
ABORT = f"{VERSION_PREFIX}.abort"

# Tenants (docs/services.md, "Security model"). The tenant comes from the subject a request
# was published on (NATS permissions let a tenant's user publish only its own), never from
# the body. A tenant's stream replies must be inside its own inbox prefix, which only its
# user may subscribe to; the default tenant's replies must be outside every tenant's.
DEFAULT_TENANT = ""
TENANT_PREFIX = f"{VERSION_PREFIX}.tenant"
TENANT_GENERATE_ALL = f"{TENANT_PREFIX}.*.generate"
TENANT_ABORT_ALL = f"{TENANT_PREFIX}.*.abort"
# the inbox roots client streams may use (the services' users may publish there, clients'
# users may only subscribe); a reply subject elsewhere is refused
CLIENT_INBOX_ROOT = "_INBOX"
TENANT_INBOX_ROOT = f"{CLIENT_INBOX_ROOT}.tenant"
# the HTTP gateway's stream inboxes (reply subjects of its generate requests): outside _INBOX,
# so NATS clients, who share _INBOX.>, cannot read the streams of HTTP users (and cannot
# write into one without guessing its random 64-bit key)
GATEWAY_INBOX_PREFIX = "_GW_INBOX"
# where the default tenant's streams may go (a front end with its own inbox root adds it here;
# services/runtime/permissions.py lets the services publish to each)
DEFAULT_INBOX_ROOTS: tuple[str, ...] = (CLIENT_INBOX_ROOT, GATEWAY_INBOX_PREFIX)
_TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_tenant(tenant: str) -> str:
    """A tenant name: 1-32 of [a-z0-9_-], starting with a letter or digit (a subject token)."""
    if not _TENANT_NAME.match(tenant):
        raise ValueError(f"tenant name {tenant!r} must be 1-32 characters of [a-z0-9_-]")
    return tenant


def tenant_generate(tenant: str) -> str:
    return GENERATE if tenant == DEFAULT_TENANT else f"{TENANT_PREFIX}.{tenant}.generate"


def tenant_abort(tenant: str) -> str:
    return ABORT if tenant == DEFAULT_TENANT else f"{TENANT_PREFIX}.{tenant}.abort"


def tenant_of(subject: str) -> str | None:
    """The tenant a public subject belongs to; None if it is not a public request subject."""
    if subject in (GENERATE, ABORT):
        return DEFAULT_TENANT
    parts = subject.split(".")
    if len(parts) == 5 and subject.startswith(TENANT_PREFIX + ".") and _TENANT_NAME.match(parts[3]):
        return parts[3]
    return None


def tenant_inbox(tenant: str) -> str:
    """A tenant's clients' inbox prefix (nats-py ``inbox_prefix``, ``nats --inbox-prefix``)."""
    return CLIENT_INBOX_ROOT if tenant == DEFAULT_TENANT else f"{TENANT_INBOX_ROOT}.{tenant}"


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The id the services use inside: a named tenant's ids live in their own namespace
    (``acme/req-1``; '/' is in no client id and no tenant name), so no tenant can take,
    abort or replay another's id."""
    return request_id if tenant == DEFAULT_TENANT else f"{tenant}/{request_id}"


def public_request_id(request_id: str) -> str:
    """The id the client sent (``scoped_request_id`` undone)."""
    return request_id.rpartition("/")[2]


def reply_allowed(tenant: str, reply: str) -> bool:
    """Whether a generate or abort from ``tenant`` may name ``reply`` for its answers."""
    if tenant != DEFAULT_TENANT:
        return reply.startswith(tenant_inbox(tenant) + ".")
    if reply.startswith(TENANT_INBOX_ROOT + "."):
        return False
    return any(reply.startswith(root + ".") for root in DEFAULT_INBOX_ROOTS)


# admission -> scheduler (msgpack): per shard (``sched_submit(shard)``); SCHED_ABORT reaches
# every shard (an abort for a request this admission did not route)
SCHED_SUBMIT = f"{VERSION_PREFIX}.sched.submit"
SCHED_ABORT = f"{VERSION_PREFIX}.sched.abort"
# scheduler -> admission: queue depth for backpressure (msgpack)
SCHED_LOAD = f"{VERSION_PREFIX}.sched.load"
# admission -> scheduler request/reply: "are you there, and how loaded?" (when reports stop)
SCHED_LOAD_GET = f"{VERSION_PREFIX}.sched.load.get"
# one scheduler instance's own subject: admission and workers ask it "are you there?". Its
# "no responders" proves nats-server dropped that scheduler's connection (it can publish
# nothing more there), which is what makes it safe to end its requests elsewhere (fencing)
SCHED_ALIVE = f"{VERSION_PREFIX}.sched.alive"
SCHED_ALIVE_ALL = f"{SCHED_ALIVE}.*"


def sched_alive(instance: str) -> str:
    return f"{SCHED_ALIVE}.{instance}"


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
    """Reply subject of one scheduler epoch's batches (``<instance>.<epoch number>``). Being
    the batch's reply subject, it also receives nats-server's "no responders" status when no
    worker is subscribed, and the epoch in the subject says which batches it was about."""
    return f"{WORKER_RESULT}.{epoch}"


def worker_results_of(instance: str) -> str:
    """Wildcard over every epoch of one scheduler instance."""
    return f"{WORKER_RESULT}.{instance}.*"


# disaggregation (prefill/decode shards)
WORKER_KV_META = f"{VERSION_PREFIX}.worker.kvmeta"
SCHED_KV_RELEASE = f"{VERSION_PREFIX}.sched.kvrelease"
WORKER_KV_ACK = f"{VERSION_PREFIX}.worker.kvack"
_KV_RESULTS = "kv"


def worker_kv_meta(worker_id: str) -> str:
    """A worker's description of its KV for peers that pull from it (request/reply)."""
    return f"{WORKER_KV_META}.{worker_id}"


def worker_kv_results(epoch: str) -> str:
    """Where a worker reports the KV pulls of one scheduler epoch."""
    return f"{WORKER_RESULT}.{epoch}.{_KV_RESULTS}"


def worker_kv_results_of(instance: str) -> str:
    return f"{WORKER_RESULT}.{instance}.*.{_KV_RESULTS}"


def worker_kv_ack(worker_id: str) -> str:
    """Where a decode worker hears that its scheduler has its pull results."""
    return f"{WORKER_KV_ACK}.{worker_id}"


def sched_kv_release(scheduler_id: str) -> str:
    """A prefill scheduler instance's handoffs: released by the decode side (request/reply)."""
    return f"{SCHED_KV_RELEASE}.{scheduler_id}"


# admission <- scheduler: per-request tracking subject (the submit's reply subject) that
# receives RequestNotice ("accepted"; "done" once a retry took the stream elsewhere) and,
# when no scheduler listens, the "no responders" status for the submit itself
ADMISSION_TRACK_PREFIX = f"{VERSION_PREFIX}.adm"


def admission_track(admission_id: str, seq: int) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.{seq}"


def track_try(subject: str) -> tuple[str, int] | None:
    """(admission id, seq) of an admission tracking subject, None for any other subject."""
    head, _, seq = subject.rpartition(".")
    prefix, _, admission_id = head.rpartition(".")
    if prefix != ADMISSION_TRACK_PREFIX or not admission_id or not seq.isdigit():
        return None
    return admission_id, int(seq)


def admission_tracks_of(admission_id: str) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.{admission_id}.*"


# scheduler -> admission request/reply: "which of my requests did you end while I was cut
# off or stalled?" (a FenceQuery; the answer is a FenceUpdate)
def admission_fence(admission_id: str) -> str:
    return f"{ADMISSION_TRACK_PREFIX}.fence.{admission_id}"


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


# service -> gateway: each scheduler/worker instance's Prometheus metrics (exposition text,
# headers Rlt-Service / Rlt-Instance), merged by the gateway into one /metrics
METRICS_PREFIX = f"{VERSION_PREFIX}.metrics"


def metrics(service: str) -> str:
    return f"{METRICS_PREFIX}.{service}"


METRICS_ALL = f"{METRICS_PREFIX}.>"


def gateway_inbox(gateway_id: str) -> str:
    """Prefix of one gateway instance's stream inboxes (``<prefix>.<stream no>``)."""
    return f"{GATEWAY_INBOX_PREFIX}.{gateway_id}"


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
SERVICE_NAMES = ("admission", "scheduler", "worker", "prefix-cache", "gateway")


def micro_name(service: str) -> str:
    return f"rlt-{service}"
