"""The JetStream pieces the services share: the prefix-event stream and the snapshot bucket.

Whichever service needs one first creates it, and every service that starts brings it up to
date (idempotent). Replicas: as many as the cluster has nodes, up to 3 (R3 survives one node
loss with a quorum left); a single server gets R1. The count is read from the server's INFO
(its cluster peers' client URLs) and, should the server refuse it (``no_advertise``, nodes
down), lowered until it is accepted. An existing stream is never lowered.

Retention of the event stream (``EventStreamLimits``, docs/services.md): bounded by age
(``RLT_PREFIX_STREAM_MAX_AGE_S``, 1 h) and size (``RLT_PREFIX_STREAM_MAX_BYTES``, 256 MiB);
the oldest messages go first. An index that was down longer than that cannot replay what aged
out: it notices the hole in the stream sequence and drops what it cannot vouch for.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js import errors as js_errors

from services.runtime import subjects

T = TypeVar("T")

EVENT_STREAM = "RLT_PREFIX_EVENTS"
SNAPSHOT_BUCKET = "RLT_PREFIX_INDEX"
MAX_REPLICAS = 3
# nats-server's answers when a stream asks for more replicas than it can place:
# "replicas > 1 not supported in non-clustered mode", "insufficient resources"
_TOO_MANY_REPLICAS = (10074, 10023)
# JetStream is briefly unavailable while a cluster elects its leaders: retried, not fatal
TRANSIENT = (
    js_errors.ServiceUnavailableError,
    js_errors.ServerError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    asyncio.TimeoutError,
)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass(frozen=True)
class EventStreamLimits:
    max_age_s: float = 3600.0
    max_bytes: int = 256 << 20
    # a publisher's retry with the same Nats-Msg-Id within this window is stored once
    duplicate_window_s: float = 120.0

    @classmethod
    def from_env(cls) -> EventStreamLimits:
        base = cls()
        return cls(
            max_age_s=_env_float("RLT_PREFIX_STREAM_MAX_AGE_S", base.max_age_s),
            max_bytes=int(_env_float("RLT_PREFIX_STREAM_MAX_BYTES", base.max_bytes)),
            duplicate_window_s=base.duplicate_window_s,
        )


def event_stream_config(replicas: int, limits: EventStreamLimits) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=EVENT_STREAM,
        description="rlt prefix-cache events (BlockStored/BlockRemoved/AllBlocksCleared)",
        subjects=[subjects.PREFIX_EVENTS_ALL],
        retention=js_api.RetentionPolicy.LIMITS,
        discard=js_api.DiscardPolicy.OLD,
        max_age=limits.max_age_s,
        max_bytes=limits.max_bytes,
        storage=js_api.StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=limits.duplicate_window_s,
    )


def cluster_size(nc: NATS) -> int:
    """Nodes of the cluster the connection is in, as its server advertises them (1 alone)."""
    info: dict[str, Any] = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    urls = set(info.get("connect_urls") or [])
    return max(len(urls), len({u.netloc for u in nc.servers}), 1)


def wanted_replicas(nc: NATS) -> int:
    return min(MAX_REPLICAS, cluster_size(nc))


async def retry_transient(
    what: Callable[[], Awaitable[T]], timeout_s: float, log: Any = None, label: str = ""
) -> T:
    """Runs ``what`` until it does not fail with a transient JetStream error (or time is up)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            return await what()
        except TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                raise
            if log is not None:
                log.info("jetstream not ready; retrying", what=label, error=repr(exc)[:200])
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def _place(
    want: int, existing: int, apply: Callable[[int], Awaitable[None]], log: Any
) -> int:
    """Applies a config with ``want`` replicas, lowering the count while the server refuses
    it for lack of nodes; never below ``existing`` (a stream is not shrunk)."""
    replicas = max(want, existing)
    while True:
        try:
            await apply(replicas)
            return replicas
        except js_errors.BadRequestError as exc:
            if exc.err_code not in _TOO_MANY_REPLICAS or replicas <= max(existing, 1):
                raise
            if log is not None:
                log.info("fewer jetstream replicas", tried=replicas, error=exc.description)
            replicas -= 1


async def ensure_event_stream(
    nc: NATS, limits: EventStreamLimits | None = None, log: Any = None
) -> int:
    """Creates the prefix-event stream, or updates it (limits, more replicas); returns its
    replica count."""
    js = nc.jetstream()
    limits = limits or EventStreamLimits.from_env()
    try:
        info = await js.stream_info(EVENT_STREAM)
    except js_errors.NotFoundError:
        info = None

    async def apply(replicas: int) -> None:
        config = event_stream_config(replicas, limits)
        if info is None:
            await js.add_stream(config)
        elif _differs(info.config, config):
            await js.update_stream(config)

    existing = (info.config.num_replicas or 1) if info is not None else 0
    replicas = await _place(wanted_replicas(nc), existing, apply, log)
    if log is not None and (info is None or replicas != existing):
        log.info("event stream ready", stream=EVENT_STREAM, replicas=replicas)
    return replicas


def _differs(current: js_api.StreamConfig, wanted: js_api.StreamConfig) -> bool:
    return (
        (current.num_replicas or 1) < (wanted.num_replicas or 1)
        or current.subjects != wanted.subjects
        or current.max_age != wanted.max_age
        or current.max_bytes != wanted.max_bytes
        or current.duplicate_window != wanted.duplicate_window
    )


async def snapshot_store(nc: NATS, log: Any = None) -> Any:
    """The object store the prefix index writes its snapshots to (created if missing)."""
    js: JetStreamContext = nc.jetstream()
    try:
        return await js.object_store(SNAPSHOT_BUCKET)
    except js_errors.NotFoundError:
        pass
    store: list[Any] = []

    async def apply(replicas: int) -> None:
        config = js_api.ObjectStoreConfig(
            bucket=SNAPSHOT_BUCKET,
            description="rlt prefix-index snapshots",
            storage=js_api.StorageType.FILE,
            replicas=replicas,
        )
        store.append(await js.create_object_store(SNAPSHOT_BUCKET, config=config))

    replicas = await _place(wanted_replicas(nc), 0, apply, log)
    if log is not None:
        log.info("snapshot bucket ready", bucket=SNAPSHOT_BUCKET, replicas=replicas)
    return store[-1]
