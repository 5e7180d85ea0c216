"""Gateway actor: an OpenAI-compatible HTTP server (uvicorn, in this service's event loop)
in front of the NATS API, and the whole system's ``/metrics``.

It acts as a NATS client: requests go to ``rlt.v1.generate`` (W3C ``traceparent`` and
``Rlt-Trace-Id`` headers) with a reply subject under the gateway's own inbox
``_GW_INBOX.<instance>.<random>``; one wildcard subscription hands each message to the
request it belongs to. Aborts go to ``rlt.v1.abort``. Health pings of admission, a
scheduler and a worker decide ``/health``. Every scheduler and worker publishes its metrics
on ``rlt.v1.metrics.<service>``; the gateway keeps the latest of each instance
(``metrics.py``).

Stopping: new HTTP requests get 503, the ones in flight finish (up to the drain timeout),
then the HTTP server closes.

The HTTP server is ``edge.py``'s: uvicorn's httptools protocol with a bounded request head.
With API keys, ``/v1/*`` (and with metrics keys ``/metrics``) need ``Authorization:
Bearer <key>`` (``auth.py``).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg

from messages.api import AbortRequest, ErrorEvent, GenerateRequest, StreamEvent
from messages.errors import ErrorCode
from services.common.checkpoint import load_model_limits
from services.common.tokenizer import TextCodec
from services.gateway.app import build_app
from services.gateway.auth import ApiKeys
from services.gateway.edge import HttpLimits, Server, http_server
from services.gateway.metrics import GatewayMetrics
from services.gateway.process import bind_http, model_name_for
from services.runtime import subjects
from services.runtime.bus import (
    HEADER_TRACE_ID,
    encode_json,
    fits,
    is_no_responders,
    json_decoder,
)
from services.runtime.logging import request_fields
from services.runtime.metrics import HEADER_SERVICE, MetricsReceiver, metrics_interval_s
from services.runtime.service import Endpoint, Service
from services.runtime.tracing import TRACEPARENT, Tracer

DEFAULT_HTTP_PORT = 8000
# what /health needs to answer: someone to take requests, schedule them and run them
READY_NEEDS = ("admission", "scheduler", "worker")
_EVENT = json_decoder(StreamEvent)  # type: ignore[arg-type]


class _Inbox:
    """The gateway's reply subjects: one wildcard subscription, one queue per open stream.
    Keys are random, so a stream's subject cannot be guessed by other NATS clients."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._queues: dict[str, asyncio.Queue[Msg]] = {}
        self._requests: dict[str, str] = {}  # key -> the request id its stream answers

    def open(self, request_id: str = "") -> tuple[str, asyncio.Queue[Msg]]:
        key = secrets.token_hex(8)
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._queues[key] = queue
        if request_id:
            self._requests[key] = request_id
        return f"{self.prefix}.{key}", queue

    def close(self, subject: str) -> None:
        key = subject.rsplit(".", 1)[-1]
        self._queues.pop(key, None)
        self._requests.pop(key, None)

    def end_all(self, message: str) -> list[str]:
        """Ends every open request stream with an ``unavailable`` error of its own (the
        HTTP side sends it as its last frame); returns their request ids."""
        for key, rid in self._requests.items():
            self._queues[key].put_nowait(_error_msg(rid, ErrorCode.UNAVAILABLE, message))
        return list(self._requests.values())

    def deliver(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject.rsplit(".", 1)[-1])
        if queue is not None:
            queue.put_nowait(msg)

    def __len__(self) -> int:
        return len(self._queues)


class _Stream:
    """One request's stream of events on its reply subject."""

    def __init__(
        self,
        inbox: _Inbox,
        subject: str,
        queue: asyncio.Queue[Msg],
        rid: str,
        on_absent: Callable[[], None],
    ) -> None:
        self._inbox = inbox
        self._subject = subject
        self._queue = queue
        self._rid = rid
        self._on_absent = on_absent

    async def next(self, timeout: float) -> StreamEvent:
        try:
            msg = self._queue.get_nowait()  # the common case under load: no timer, no task
        except asyncio.QueueEmpty:
            async with asyncio.timeout(timeout):
                msg = await self._queue.get()
        return self._decode(msg)

    def next_nowait(self) -> StreamEvent | None:
        """An event that already arrived, or None."""
        try:
            return self._decode(self._queue.get_nowait())
        except asyncio.QueueEmpty:
            return None

    def _decode(self, msg: Msg) -> StreamEvent:
        if is_no_responders(msg):
            self._on_absent()  # readiness must not go on answering from a stale cache
            return ErrorEvent(
                request_id=self._rid,
                code=str(ErrorCode.UNAVAILABLE),
                message="no admission service is running",
            )
        try:
            return _EVENT.decode(msg.data)
        except msgspec.DecodeError as exc:
            return ErrorEvent(
                request_id=self._rid,
                code=str(ErrorCode.INTERNAL),
                message=f"undecodable event from the engine: {exc}",
            )

    def close(self) -> None:
        self._inbox.close(self._subject)


class GatewayService(Service):
    name = "gateway"
    description = "OpenAI-compatible HTTP API, /metrics and /health in front of the NATS API"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_HTTP_PORT,
        served_model_name: str | None = None,
        request_timeout_s: float = 3600.0 + 60.0,
        listen_fd: int | None = None,
        api_keys: Sequence[str] = (),
        metrics_api_keys: Sequence[str] = (),
        http_limits: HttpLimits | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.checkpoint = Path(checkpoint)
        self.host = host
        self.port = port
        # the model's name in the API: what clients put in "model"
        self.model_name = model_name_for(self.checkpoint, served_model_name)
        # a socket already listening, handed over by `rlt up` (services/gateway/process.py)
        self.listen_fd = listen_fd
        self.request_timeout_s = request_timeout_s
        # Authorization: Bearer <key> on /v1/* and on /metrics (none: open)
        self.api_keys = ApiKeys(api_keys)
        self.metrics_api_keys = ApiKeys(metrics_api_keys)
        self.http_limits = http_limits or HttpLimits()
        self.created = int(time.time())
        self.max_model_len = 0
        self.codec: TextCodec | None = None
        self.tracer = Tracer(self.name)
        self.metrics = GatewayMetrics(
            self.model_name, stale_after_s=max(15.0, 10 * metrics_interval_s())
        )
        self._metrics_in = MetricsReceiver()
        self.inbox = _Inbox(subjects.gateway_inbox(self.instance_id))
        self._socket: socket.socket | None = None
        self._server: Server | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._ready_cache: tuple[float, bool, dict[str, Any]] = (float("-inf"), False, {})

    # ------------------------------------------------------------------ lifecycle
    async def setup(self) -> None:
        self.max_model_len = load_model_limits(self.checkpoint).max_position_embeddings
        self.codec = await asyncio.to_thread(TextCodec.from_checkpoint, self.checkpoint)
        if self.listen_fd is not None:
            self._socket = socket.socket(fileno=self.listen_fd)
            self._socket.setblocking(False)
        else:
            # bound here, so a port in use fails the start with a clear error (uvicorn
            # would call sys.exit inside its task)
            self._socket = bind_http(self.host, self.port)
        self.port = self._socket.getsockname()[1]

    def endpoints(self) -> Sequence[Endpoint]:
        return (
            # plain: "no responders" for a generate (no admission) arrives here too
            Endpoint("streams", f"{self.inbox.prefix}.*", self._on_stream, micro=False),
            # every gateway replica needs every instance's metrics: a queue group of its own
            Endpoint(
                "metrics",
                subjects.METRICS_ALL,
                self._on_metrics,
                queue_group=f"rlt-gateway-{self.instance_id}",
            ),
        )

    async def on_ready(self) -> None:
        app = build_app(self, self.api_keys, self.metrics_api_keys)
        self._server = http_server(app, self.metrics, self.log, self.http_limits)
        assert self._socket is not None
        self._server_task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started and not self._server_task.done():
            await asyncio.sleep(0.01)
        if self._server_task.done():
            self._server_task.result()  # raises what stopped it
        self.log.info(
            "http listening",
            url=f"http://{self.host}:{self.port}",
            model=self.model_name,
            api_keys=len(self.api_keys),  # how many, never which
            metrics_api_keys=len(self.metrics_api_keys),
        )

    async def drain(self, timeout: float) -> None:
        """Answers in flight run on for ``timeout``; then each ends with an ``unavailable``
        error (an error frame then ``[DONE]`` for a stream, a 503 otherwise) and is aborted
        upstream, before the HTTP server stops."""
        deadline = time.monotonic() + timeout
        while len(self.inbox) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = self.inbox.end_all("the gateway shut down before the answer finished; retry it")
        for rid in cut:
            self.abort_soon(rid, "")
        if cut:
            self.log.warning("answers cut by the shutdown", requests=len(cut))
        give_up = time.monotonic() + 2.0  # their last frames go out
        while len(self.inbox) and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        await self._stop_http()

    async def teardown(self) -> None:
        await self._stop_http()
        if self._socket is not None:
            self._socket.close()

    async def _stop_http(self) -> None:
        if self._server is None or self._server_task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._server_task), timeout=10)
        except TimeoutError:
            self._server.force_exit = True
            await asyncio.gather(self._server_task, return_exceptions=True)
        except Exception as exc:
            self.log.warning("http server stopped with an error", error=repr(exc)[:200])

    def health_details(self) -> dict[str, Any]:
        return {
            "http_port": self.port,
            "model": self.model_name,
            "open_streams": len(self.inbox),
            "metrics_instances": len(self.metrics.cluster.instances()),
        }

    # ------------------------------------------------------------------ for the HTTP side
    async def open_stream(
        self, request: GenerateRequest, traceparent: str, trace_id: str
    ) -> _Stream:
        assert request.request_id is not None
        subject, queue = self.inbox.open(request.request_id)
        headers = {TRACEPARENT: traceparent, HEADER_TRACE_ID: trace_id}
        try:
            data = encode_json(request)
        except RecursionError:  # decoded a few frames shallower than this: at the edge
            message = "invalid JSON: nested too deeply"
            queue.put_nowait(_error_msg(request.request_id, ErrorCode.INVALID_REQUEST, message))
            return self._stream(subject, queue, request.request_id)
        if not fits(self.nc, len(data)):  # a retry would not help: say what is wrong
            message = (
                f"the request is too large: {len(data)} bytes as JSON, over the bus's "
                f"max_payload ({self.nc.max_payload} bytes); send a shorter prompt"
            )
            queue.put_nowait(_error_msg(request.request_id, ErrorCode.INVALID_REQUEST, message))
            return self._stream(subject, queue, request.request_id)
        try:
            await self.nc.publish(subjects.GENERATE, data, reply=subject, headers=headers)
        except Exception as exc:  # the bus is down: the client hears "unavailable"
            self.log.warning("generate not sent", error=repr(exc)[:200])
            queue.put_nowait(_no_responders(subject))
        return self._stream(subject, queue, request.request_id)

    def _stream(self, subject: str, queue: asyncio.Queue[Msg], request_id: str) -> _Stream:
        return _Stream(self.inbox, subject, queue, request_id, self._forget_readiness)

    def _forget_readiness(self) -> None:
        self._ready_cache = (float("-inf"), False, {})

    def abort_soon(self, request_id: str, trace_id: str) -> None:
        """Sends an abort without waiting (callable from a cancelled task's cleanup)."""
        task = asyncio.ensure_future(self._abort(request_id, trace_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, request_id: str, trace_id: str) -> None:
        try:
            await self.nc.publish(
                subjects.ABORT,
                encode_json(AbortRequest(request_id=request_id)),
                headers={HEADER_TRACE_ID: trace_id},
            )
            self.log.info("request aborted", **request_fields(request_id, trace_id))
        except Exception as exc:
            self.log.warning("abort not sent", error=repr(exc)[:200], request_id=request_id)

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when admission, a scheduler and a worker answer their health pings (cached
        for a second, so probes cost the bus little)."""
        if self.draining:  # before the cache: a load balancer must stop sending at once
            return False, {"services": {"gateway": "draining"}}
        at, ready, details = self._ready_cache
        if time.monotonic() - at < 1.0:
            return ready, details
        states = await asyncio.gather(*(self._ping(name) for name in READY_NEEDS))
        services = dict(zip(READY_NEEDS, states, strict=True))
        ready = all(state == "ready" for state in states)
        self._ready_cache = (time.monotonic(), ready, {"services": services})
        return ready, {"services": services}

    async def _ping(self, service: str) -> str:
        subject, queue = self.inbox.open()
        try:
            await self.nc.publish(subjects.health(service), b"", reply=subject)
            msg = await asyncio.wait_for(queue.get(), 1.0)
            if is_no_responders(msg):
                return "absent"
            return str(msgspec.json.decode(msg.data).get("status", "unknown"))
        except TimeoutError:
            return "no answer"
        except Exception as exc:
            return f"error: {exc!r}"[:100]
        finally:
            self.inbox.close(subject)

    # ------------------------------------------------------------------ NATS handlers
    async def _on_stream(self, msg: Msg) -> None:
        self.inbox.deliver(msg)

    async def _on_metrics(self, msg: Msg) -> None:
        try:
            got = self._metrics_in.feed(msg)
            if got is not None:
                self.metrics.cluster.update(got.service, got.instance, got.text, shard=got.shard)
        except ValueError as exc:  # not UTF-8, or not Prometheus text
            service = (msg.headers or {}).get(HEADER_SERVICE)
            self.log.warning("unreadable metrics", service=service, error=repr(exc)[:200])


def _error_msg(request_id: str, code: ErrorCode, message: str) -> Msg:
    """An error event of the gateway's own, queued where the stream's events arrive."""
    event = ErrorEvent(request_id=request_id, code=code, message=message)
    return Msg(None, data=encode_json(event))  # type: ignore[arg-type]


def _no_responders(subject: str) -> Msg:
    """A stand-in for nats-server's "no responders" status (the publish itself failed)."""
    return Msg(None, subject=subject, data=b"", headers={"Status": "503"})  # type: ignore[arg-type]
