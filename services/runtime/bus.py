"""NATS plumbing: connecting with reconnects, codecs built once, bounded-concurrency handlers.

Public subjects use msgspec JSON, internal ones msgpack. Encoders and per-type decoders are
created once and reused: building them per message would cost more than the encode itself.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.runtime import subjects

T = TypeVar("T")

# headers that carry request identity on internal messages whose body does not
HEADER_REQUEST_ID = "Rlt-Request-Id"
# where a client or service looks for NATS when told nothing else
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
HEADER_TRACE_ID = "Rlt-Trace-Id"
# "<message id> <index> <count>" on each part of a message split to fit nc.max_payload
HEADER_CHUNK = "Rlt-Chunk"
# room left for headers and the protocol line when sizing a message against max_payload
PAYLOAD_HEADROOM = 1024
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


def auth_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nats-py credentials from the environment, for services and clients alike:

    - ``RLT_NATS_USER`` + ``RLT_NATS_PASSWORD`` (or ``RLT_NATS_PASSWORD_FILE``, e.g. a
      Docker secret), or credentials in the URL (``nats://user:pass@host:4222``);
    - ``RLT_NATS_TOKEN`` (or ``RLT_NATS_TOKEN_FILE``);
    - ``RLT_NATS_CREDS``: a ``.creds`` file (JWT + nkey seed), or ``RLT_NATS_NKEY_SEED``: an
      nkey seed file. Both need the ``nkeys`` package.
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}

    def secret(name: str) -> str | None:
        if env.get(name):
            return env[name]
        path = env.get(f"{name}_FILE")
        return Path(path).read_text().strip() if path else None

    user = env.get("RLT_NATS_USER")
    token = secret("RLT_NATS_TOKEN")
    if user:
        out.update(user=user, password=secret("RLT_NATS_PASSWORD") or "")
    elif token:
        out["token"] = token
    creds, seed = env.get("RLT_NATS_CREDS"), env.get("RLT_NATS_NKEY_SEED")
    if (creds or seed) and importlib.util.find_spec("nkeys") is None:
        raise ConnectionError(
            "RLT_NATS_CREDS / RLT_NATS_NKEY_SEED need the nkeys package: pip install nkeys"
        )
    if creds:
        out["user_credentials"] = creds
    elif seed:
        out["nkeys_seed"] = seed
    return out


def with_credentials(url: str, user: str, password: str) -> str:
    """``nats://host:port[,...]`` with ``user:password@`` in every listed server."""
    out = []
    for server in server_list(url):
        parts = urlsplit(server)
        host = parts.netloc.rsplit("@", 1)[-1]
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
        out.append(urlunsplit(parts._replace(netloc=netloc)))
    return ",".join(out)


def redact_url(url: str) -> str:
    """A server URL (list) fit for logs and banners: any password replaced by ``***``."""
    out = []
    for server in url.split(","):
        parts = urlsplit(server.strip())
        if parts.password is None:
            out.append(server.strip())
            continue
        host = parts.netloc.rsplit("@", 1)[-1]
        out.append(urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}")))
    return ",".join(out)


def split_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``nats://user:pass@host:port[,...]`` -> the URLs without credentials, and the
    credentials as nats-py options (``{}`` if none). Passed as options they hold for every
    server, also those nats-server announces in a cluster (which nats-py would otherwise
    try without credentials)."""
    plain, creds = [], {}
    for server in server_list(url):
        parts = urlsplit(server)
        if parts.username is not None:
            user, password = unquote(parts.username), unquote(parts.password or "")
            creds = {"user": user, "password": password} if password else {"token": user}
        plain.append(urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])))
    return ",".join(plain), creds


def default_client_url_file(tenant: str = subjects.DEFAULT_TENANT) -> Path:
    """Where ``rlt up`` leaves the client URL (with the client credentials) and where the
    ``rlt`` client looks for it: ``$RLT_CLIENT_URL_FILE``, else ``~/.rlt/client-url``; a
    named tenant's is the same path with ``.<tenant>`` appended."""
    base = Path(os.environ.get("RLT_CLIENT_URL_FILE") or Path.home() / ".rlt" / "client-url")
    return base if tenant == subjects.DEFAULT_TENANT else base.with_name(f"{base.name}.{tenant}")


def write_secret(path: Path, text: str) -> None:
    """Writes ``text`` readable by this OS user only (the directory is made 0700 if new)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def server_list(url: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` (as ``--nats-url`` / ``RLT_NATS_URL`` take it) as the
    list nats-py wants: the client connects to one and fails over to the others."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 60.0,
    log: Any = None,
    closing: Callable[[], bool] = lambda: False,
    on_disconnected: Callable[[], Awaitable[None]] | None = None,
    on_reconnected: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connects within ``connect_timeout_s`` (a service may start before NATS is up), then
    reconnects forever with a short wait, so a NATS restart is survivable. ``url`` may list
    several servers (comma-separated, a cluster): a lost node fails over to another.
    Credentials come from the environment (``auth_options``).

    nats-py retries the first connection itself (``max_reconnect_attempts=-1``); the
    timeout bounds that, and the failures are logged at most every few seconds. An
    authorization failure is not retried: it will not fix itself."""
    connected = False
    url, url_auth = split_credentials(url)
    auth = url_auth or auth_options()
    auth_failed: list[Exception] = []
    last_waiting_log = float("-inf")

    async def on_error(exc: Exception) -> None:
        nonlocal last_waiting_log
        if "authorization" in str(exc).lower() and not connected:
            auth_failed.append(exc)
        if log is None:
            return
        if connected:
            log.warning("nats error", error=repr(exc))
        elif time.monotonic() - last_waiting_log > 5.0:
            last_waiting_log = time.monotonic()
            log.info("waiting for nats", url=redact_url(url), error=repr(exc))

    async def disconnected_cb() -> None:
        if closing():  # quiet on our own drain/close
            return
        if log is not None:
            log.warning("nats disconnected")
        if on_disconnected is not None:
            await on_disconnected()

    async def reconnected_cb() -> None:
        if log is not None:
            log.info("nats reconnected")
        if on_reconnected is not None:
            await on_reconnected()

    connecting = asyncio.ensure_future(
        nats.connect(
            server_list(url),
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=2,
            ping_interval=20,
            # the stream replies are many small messages: a bigger buffer, fewer flushes
            pending_size=8 * 1024 * 1024,
            inbox_prefix=subjects.service_inbox(name),
            error_cb=on_error,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            **auth,
        )
    )
    deadline = time.monotonic() + connect_timeout_s
    try:
        while not connecting.done():
            if auth_failed:
                raise ConnectionError(
                    f"NATS at {redact_url(url)} refused our credentials: {auth_failed[0]!r} "
                    "(check RLT_NATS_USER / RLT_NATS_PASSWORD / RLT_NATS_CREDS)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no connection within {connect_timeout_s}s")
            await asyncio.wait({connecting}, timeout=0.1)
        nc = connecting.result()
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise ConnectionError(f"could not connect to NATS at {redact_url(url)}: {exc!r}") from exc
    finally:
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
    connected = True
    return nc


# ---------------------------------------------------------------------- large messages
def fits(nc: NATS, size: int) -> bool:
    """Whether a message body of ``size`` bytes fits the server's max_payload."""
    return size + PAYLOAD_HEADROOM <= nc.max_payload


async def publish_chunked(
    nc: NATS,
    subject: str,
    payload: bytes,
    reply: str = "",
    chunk_size: int | None = None,
    headers: dict[str, str] | None = None,
) -> int:
    """Publishes ``payload``, split into parts with an ``Rlt-Chunk`` header when it would
    not fit ``nc.max_payload`` (a batch full of new prompts can be several MB). The receiver
    joins them with a ``Reassembler``. ``headers`` go with every part. Returns the number of
    messages sent."""
    size = chunk_size or (nc.max_payload - PAYLOAD_HEADROOM)
    if len(payload) <= size:
        await nc.publish(subject, payload, reply=reply, headers=headers)
        return 1
    mid = uuid.uuid4().hex[:16]
    count = -(-len(payload) // size)
    for i in range(count):
        await nc.publish(
            subject,
            payload[i * size : (i + 1) * size],
            reply=reply,
            headers={**(headers or {}), HEADER_CHUNK: f"{mid} {i} {count}"},
        )
    return count


class Reassembler:
    """Joins messages split by ``publish_chunked``; whole messages pass straight through.

    Bounded: at most ``max_partial`` messages are assembled at once and ``max_bytes`` held
    in their parts (the oldest incomplete one is dropped: its sender times out or re-sends),
    and a message may have at most ``max_parts`` parts. NATS core does not say who sent a
    message, so the bound is per receiver; only the engine's own services may publish
    where a reassembler listens (services/runtime/permissions.py). A malformed chunk header
    drops that part, never raises."""

    def __init__(
        self, max_partial: int = 8, max_parts: int = 1024, max_bytes: int = 128 << 20
    ) -> None:
        self.max_partial = max_partial
        self.max_parts = max_parts
        self.max_bytes = max_bytes
        self._partial: OrderedDict[str, list[bytes | None]] = OrderedDict()
        self.bytes = 0  # held in parts of incomplete messages
        self.dropped = 0
        self.joined = 0  # messages put back together from parts

    def feed(self, msg: Msg) -> bytes | None:
        header = msg.headers.get(HEADER_CHUNK) if msg.headers else None
        if header is None:
            return msg.data
        try:
            mid, index_s, count_s = header.split(" ")
            index, count = int(index_s), int(count_s)
        except ValueError:
            self.dropped += 1
            return None
        if not (0 <= index < count <= self.max_parts) or not mid or len(mid) > 64:
            self.dropped += 1
            return None
        parts = self._partial.get(mid)
        if parts is None:
            parts = self._partial[mid] = [None] * count
        elif len(parts) != count:
            self.dropped += 1
            return None
        if parts[index] is not None:
            self.bytes -= len(parts[index])  # type: ignore[arg-type]
        parts[index] = msg.data
        self.bytes += len(msg.data)
        self._bound(keep=mid)
        if mid not in self._partial or any(p is None for p in parts):
            return None
        self._forget(mid)
        self.joined += 1
        return b"".join(p for p in parts if p is not None)

    def _bound(self, keep: str) -> None:
        """Drops the oldest incomplete messages (``keep`` last) until within the bounds."""
        while self._partial and (
            len(self._partial) > self.max_partial or self.bytes > self.max_bytes
        ):
            oldest = next(iter(self._partial))
            if oldest == keep and len(self._partial) > 1:
                self._partial.move_to_end(keep)
                continue
            self._forget(oldest)
            self.dropped += 1

    def _forget(self, mid: str) -> None:
        parts = self._partial.pop(mid)
        self.bytes -= sum(len(p) for p in parts if p is not None)


Handler = Callable[[Any], Awaitable[None]]


class BoundedHandler:
    """Runs a message handler with at most ``max_concurrency`` invocations at once.

    With 1 the handler runs inline, so messages are handled strictly in arrival order.
    Above 1 each message gets a task; when the limit is reached the subscription stops
    reading (messages wait in the client's bounded pending queue) instead of piling up tasks.
    """

    def __init__(
        self,
        handler: Handler,
        max_concurrency: int = 1,
        log: Any = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self._handler = handler
        self._limit = max_concurrency
        self._sem = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = log
        # told of every exception the handler raised (the service counts it in micro stats)
        self._on_error = on_error
        self.num_errors = 0

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
        except Exception as exc:
            self.num_errors += 1
            if self._log is not None:
                self._log.exception("handler failed")
            if self._on_error is not None:
                self._on_error(exc)

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Waits for the handlers in flight (graceful drain)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
