"""NATS plumbing: connecting with reconnects, codecs built once, bounded-concurrency handlers.

Public subjects use msgspec JSON, internal ones msgpack. Encoders and per-type decoders are
created once and reused: building them per message would cost more than the encode itself.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

T = TypeVar("T")

# headers that carry request identity on internal messages whose body does not
HEADER_REQUEST_ID = "Rlt-Request-Id"
HEADER_TRACE_ID = "Rlt-Trace-Id"
# the status header nats-server sets on a "no responders" reply
_STATUS_HEADER = "Status"
_NO_RESPONDERS = "503"

_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()


def encode_json(obj: Any) -> bytes:
    return _JSON_ENCODER.encode(obj)


def encode_msgpack(obj: Any) -> bytes:
    return _MSGPACK_ENCODER.encode(obj)


@functools.cache
def json_decoder(type_: type[T]) -> msgspec.json.Decoder[T]:
    return msgspec.json.Decoder(type_)


@functools.cache
def msgpack_decoder(type_: type[T]) -> msgspec.msgpack.Decoder[T]:
    return msgspec.msgpack.Decoder(type_)


def decode_json(data: bytes, type_: type[T]) -> T:
    return json_decoder(type_).decode(data)


def decode_msgpack(data: bytes, type_: type[T]) -> T:
    return msgpack_decoder(type_).decode(data)


def is_no_responders(msg: Msg) -> bool:
    """True for the status message nats-server sends when a request had no subscriber."""
    return not msg.data and bool(msg.headers) and msg.headers.get(_STATUS_HEADER) == _NO_RESPONDERS


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 60.0,
    log: Any = None,
    closing: Callable[[], bool] = lambda: False,
) -> NATS:
    """Connects within ``connect_timeout_s`` (a service may start before NATS is up), then
    reconnects forever with a short wait, so a NATS restart is survivable.

    nats-py retries the first connection itself (``max_reconnect_attempts=-1``); the
    timeout bounds that, and the failures are logged at most every few seconds."""
    connected = False
    last_waiting_log = float("-inf")

    async def on_error(exc: Exception) -> None:
        nonlocal last_waiting_log
        if log is None:
            return
        if connected:
            log.warning("nats error", error=repr(exc))
        elif time.monotonic() - last_waiting_log > 5.0:
            last_waiting_log = time.monotonic()
            log.info("waiting for nats", url=url, error=repr(exc))

    async def on_disconnected() -> None:
        if log is not None and not closing():  # quiet on our own drain/close
            log.warning("nats disconnected")

    async def on_reconnected() -> None:
        if log is not None:
            log.info("nats reconnected")

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                ping_interval=20,
                # the stream replies are many small messages: a bigger buffer, fewer flushes
                pending_size=8 * 1024 * 1024,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            ),
            timeout=connect_timeout_s,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise ConnectionError(f"could not connect to NATS at {url}: {exc!r}") from exc
    connected = True
    return nc


Handler = Callable[[Any], Awaitable[None]]


class BoundedHandler:
    """Runs a message handler with at most ``max_concurrency`` invocations at once.

    With 1 the handler runs inline, so messages are handled strictly in arrival order.
    Above 1 each message gets a task; when the limit is reached the subscription stops
    reading (messages wait in the client's bounded pending queue) instead of piling up tasks.
    """

    def __init__(self, handler: Handler, max_concurrency: int = 1, log: Any = None) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self._handler = handler
        self._limit = max_concurrency
        self._sem = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = log

    async def __call__(self, msg: Any) -> None:
        if self._limit == 1:
            await self._guarded(msg)
            return
        await self._sem.acquire()
        task = asyncio.create_task(self._run(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: Any) -> None:
        try:
            await self._guarded(msg)
        finally:
            self._sem.release()

    async def _guarded(self, msg: Any) -> None:
        # a handler bug must never kill the subscription loop
        try:
            await self._handler(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            if self._log is not None:
                self._log.exception("handler failed")

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Waits for the handlers in flight (graceful drain)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
