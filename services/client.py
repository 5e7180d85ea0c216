"""The rlt client library (what ``rlt generate`` uses): send requests over NATS, stream their
events, and ride out the failures NATS core leaves to clients.

NATS core is at-most-once, so a request can meet nobody (no admission is up: nats-server
answers "no responders" at once), and a stream's events can be lost with a dying server node.
The client therefore retries, always under the request's own ``request_id`` (one is made up
when the caller gives none), and always on the same reply subject:

- "no responders", or an ``unavailable`` error: again after a backoff (0.5 s, doubling);
- nothing heard for ``idle_s``, or the connection failed over to another node: again at once.

Retries never start a second generation: admission answers a retry of a request that already
finished from its record of finished events (docs/services.md, "Failure modes"), and the
scheduler re-attaches a retry of a live request to the running one. Token events are passed on
once per index (a re-run after an ``unavailable`` starts again at index 0); the ``finished``
event carries the whole output, whatever token events were lost.

Where: ``resolve_client_url`` picks the server (an explicit URL, ``$RLT_NATS_URL``, else the
client URL file a secured ``rlt up`` wrote, else ``nats://127.0.0.1:4222``). A ``tenant``
sends on ``rlt.v1.tenant.<tenant>.*`` and reads its streams in ``_INBOX.tenant.<tenant>``.
Events after a request's terminal event are never passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from messages.api import AbortRequest, ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from services.runtime import subjects
from services.runtime.bus import (
    DEFAULT_NATS_URL,
    auth_options,
    default_client_url_file,
    encode_json,
    is_no_responders,
    server_list,
    split_credentials,
)


def resolve_client_url(url: str | None, tenant: str = subjects.DEFAULT_TENANT) -> str:
    """The server a client talks to: ``url`` if given, else ``$RLT_NATS_URL``, else the URL
    in the client URL file ``rlt up`` wrote (``default_client_url_file``), else the local
    default."""
    if url:
        return url
    if os.environ.get("RLT_NATS_URL"):
        return os.environ["RLT_NATS_URL"]
    path = default_client_url_file(tenant)
    try:
        written = path.read_text().strip()
    except OSError:
        return DEFAULT_NATS_URL
    return written or DEFAULT_NATS_URL


Event = TokenEvent | FinishedEvent | ErrorEvent
Terminal = FinishedEvent | ErrorEvent
EventCallback = Callable[[int, Event], None]
_DECODER = msgspec.json.Decoder(Event)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5  # sends of one request, the first included
    idle_s: float = 15.0  # silence (no event) after which the request is sent again
    backoff_s: float = 0.5  # first wait after "unavailable"; doubles, at most 4 s


class CallState:
    """One request's retry state. Pure: the caller passes the clock."""

    def __init__(self, policy: RetryPolicy, now: float) -> None:
        self.policy = policy
        self.attempts = 0
        self.next_send: float | None = now
        self.next_index = 0  # the next token index to pass on
        self.done = False

    def due(self, now: float) -> bool:
        return (
            not self.done
            and self.next_send is not None
            and now >= self.next_send
            and self.attempts < self.policy.max_attempts
        )

    def sent(self, now: float) -> None:
        self.attempts += 1
        self.next_send = now + self.policy.idle_s

    def heard(self, now: float) -> None:
        if not self.done:
            self.next_send = now + self.policy.idle_s

    def reconnected(self, now: float) -> None:
        """The connection failed over: events may have been lost; ask again now."""
        if not self.done and self.attempts:
            self.next_send = now

    def token(self, event: TokenEvent) -> bool:
        """Whether to pass this token event on (not one already passed on)."""
        if self.done or event.index < self.next_index:
            return False
        self.next_index = event.index + 1
        return True

    def unavailable(self, now: float) -> bool:
        """An ``unavailable`` error or "no responders": True if that is the final answer."""
        if self.done:
            return False
        if self.attempts >= self.policy.max_attempts:
            self.done = True
            return True
        self.next_send = now + min(self.policy.backoff_s * 2 ** (self.attempts - 1), 4.0)
        return False

    def finish(self) -> None:
        self.done = True


def with_request_id(request: GenerateRequest, run: str = "") -> GenerateRequest:
    """A request id is what makes a retry safe: give one to requests that have none."""
    if request.request_id:
        return request
    request_id = f"cli-{run or uuid.uuid4().hex[:8]}-{uuid.uuid4().hex}"
    return msgspec.structs.replace(request, request_id=request_id)


async def connect_client(  # type: ignore[no-untyped-def]
    nats_url: str | None,
    timeout: float = 5.0,
    on_reconnect=None,
    tenant: str = subjects.DEFAULT_TENANT,
) -> NATS:
    """A client connection to one of the listed servers, failing over to the others, with
    the tenant's inbox prefix (the only inboxes its NATS user may read)."""

    async def quiet(_exc: Exception) -> None:  # failed attempts while failing over
        return None

    plain, creds = split_credentials(resolve_client_url(nats_url, tenant))
    connecting = asyncio.ensure_future(
        nats.connect(
            server_list(plain),
            connect_timeout=2,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            error_cb=quiet,
            reconnected_cb=on_reconnect,
            inbox_prefix=subjects.tenant_inbox(tenant),
            **(creds or auth_options()),
        )
    )
    try:
        return await asyncio.wait_for(connecting, timeout)
    except TimeoutError as exc:
        raise ConnectionError(f"no NATS server answered at {plain} within {timeout}s") from exc


async def stream_requests(
    nats_url: str | None,
    requests: Sequence[GenerateRequest],
    *,
    timeout: float,
    on_event: EventCallback | None = None,
    retry: RetryPolicy | None = None,
    tenant: str = subjects.DEFAULT_TENANT,
) -> list[Terminal]:
    """Sends every request at once; returns each one's terminal event in input order.

    ``on_event(index, event)`` sees the events of one request at a time, in input order, as
    they arrive (the other requests' events wait until their turn), so a caller can stream
    several requests to one terminal without interleaving them. Each request ends with
    exactly one terminal event; ``timeout`` bounds the whole call."""
    policy = retry or RetryPolicy()
    run = uuid.uuid4().hex[:8]
    requests = [with_request_id(r, run) for r in requests]
    loop = asyncio.get_running_loop()
    calls = [CallState(policy, loop.time()) for _ in requests]
    out: list[asyncio.Queue[Event]] = [asyncio.Queue() for _ in requests]
    wake = asyncio.Event()

    async def on_reconnect() -> None:
        for call in calls:
            call.reconnected(loop.time())
        wake.set()

    nc = await connect_client(nats_url, on_reconnect=on_reconnect, tenant=tenant)
    prefix = nc.new_inbox()
    generate, abort = subjects.tenant_generate(tenant), subjects.tenant_abort(tenant)

    async def on_msg(msg: Msg) -> None:
        i = int(msg.subject.rsplit(".", 1)[1])
        call, now = calls[i], loop.time()
        if is_no_responders(msg):
            event: Event | None = ErrorEvent(
                request_id=requests[i].request_id or "",
                code="unavailable",
                message="no rlt service answered (is it running?)",
            )
        else:
            try:
                event = _DECODER.decode(msg.data)
            except msgspec.DecodeError as exc:
                event = ErrorEvent(
                    request_id=requests[i].request_id or "",
                    code="internal",
                    message=f"undecodable reply: {exc}",
                )
        call.heard(now)
        if isinstance(event, TokenEvent):
            if call.token(event):
                out[i].put_nowait(event)
        elif isinstance(event, ErrorEvent) and event.code == "unavailable":
            if call.unavailable(now):
                out[i].put_nowait(event)
            wake.set()
        elif not call.done:
            call.finish()
            out[i].put_nowait(event)

    async def sender() -> None:
        while True:
            now = loop.time()
            for i, call in enumerate(calls):
                if call.due(now):
                    call.sent(now)
                    body = encode_json(requests[i])
                    await nc.publish(generate, body, reply=f"{prefix}.{i}")
            wake.clear()
            with_waits = [c.next_send for c in calls if c.next_send is not None and not c.done]
            pause = min([max(t - now, 0.0) for t in with_waits] + [0.25])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), pause)

    try:
        await nc.subscribe(f"{prefix}.*", cb=on_msg)
        sending = asyncio.ensure_future(sender())
        deadline = loop.time() + timeout
        results: list[Terminal] = []
        try:
            for i, request in enumerate(requests):
                rid = request.request_id or ""
                terminal = await _read(nc, abort, out[i], rid, deadline, timeout, i, on_event)
                calls[i].finish()
                results.append(terminal)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        return results
    finally:
        await nc.close()


async def _read(
    nc: NATS,
    abort_subject: str,
    queue: asyncio.Queue[Event],
    request_id: str,
    deadline: float,
    timeout: float,
    index: int,
    on_event: EventCallback | None,
) -> Terminal:
    loop = asyncio.get_running_loop()
    while True:
        try:
            event = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            # do not leave the request running for nobody
            await nc.publish(abort_subject, encode_json(AbortRequest(request_id=request_id)))
            event = ErrorEvent(
                request_id=request_id,
                code="timeout",
                message=f"no terminal event within {timeout}s",
            )
        if on_event is not None:
            on_event(index, event)
        if not isinstance(event, TokenEvent):
            return event
