"""The HTTP edge: the uvicorn server the gateway runs, and the bounds on what a connection
may send before a request reaches the app.

uvicorn's httptools protocol (the fast one, and what ``http="auto"`` picks) bounds neither
the size of a request's head (request line and headers: it buffers a header of any size)
nor the time a client may take to send it (its keep-alive timer only runs between
requests, and stops at the first byte). ``BoundedHttpTools`` adds both, as nginx's
``large_client_header_buffers`` and ``client_header_timeout`` do:

- a head over ``max_head_bytes``, or with more than ``max_header_fields`` fields, is
  answered 431 and the connection closed;
- a head not complete within ``head_timeout_s`` of the connection opening (or of its
  first byte, on a kept-alive connection) is answered 408 (or, if no byte of it came, the
  connection is just closed);
- what httptools cannot parse is answered 400.

Each of these answers is OpenAI's error shape (as every answer of the gateway), counted
(route ``other``) and logged. Websockets are off: the gateway serves none.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import msgspec
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from messages.errors import ErrorCode
from services.gateway.errors import error_body
from services.gateway.metrics import OTHER_ROUTE, GatewayMetrics

_JSON = msgspec.json.Encoder()


@dataclass(frozen=True)
class HttpLimits:
    # far above any head a client of the API sends (nginx's default is 4 x 8 KiB); a head
    # is refused at most one socket read (asyncio reads up to 256 KiB) past it
    max_head_bytes: int = 64 << 10
    max_header_fields: int = 128
    head_timeout_s: float = 10.0
    # idle time between requests on a kept-alive connection (uvicorn's default)
    keep_alive_s: int = 5


# (status or None when the connection was closed without an answer, why, the client)
Report = Callable[[int | None, str, str], None]


def _ignore(_status: int | None, _reason: str, _client: str) -> None:
    pass


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded head (size, field count, time)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    report: ClassVar[Report] = staticmethod(_ignore)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # the next bytes belong to a request's head
        self._head_started = False  # a byte of that head came
        self._heads_begun = 0
        self._head_bytes = 0
        self._header_fields = 0
        self._head_deadline: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None  # why a parser callback stopped it

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_deadline()  # a connection that sends nothing is dropped too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head and self._head_deadline is None:
            self._arm_head_deadline()
        self._unset_keepalive_if_required()
        # a head that was already under way before these bytes and still is after them:
        # every byte is its (a head that begins mid-read is counted from the next read)
        continuing, begun = self._head_started, self._heads_begun
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no websockets (nor h2c) here: the request is served as HTTP/1.1
        except httptools.HttpParserError:
            self._refuse(*(self._refusal or (400, "invalid HTTP request")))
            return
        if continuing and self._head_started and self._heads_begun == begun:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(
                    431,
                    f"the request line and headers are over {self.limits.max_head_bytes} bytes",
                )

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_head = self._head_started = True
        self._heads_begun += 1
        self._head_bytes = self._header_fields = 0
        if self._head_deadline is None:
            self._arm_head_deadline()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        if self._header_fields > self.limits.max_header_fields:
            self._refusal = (431, f"more than {self.limits.max_header_fields} header fields")
            raise httptools.HttpParserError(self._refusal[1])  # stops the parser
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = self._head_started = False
        self._disarm_head_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head = True

    def send_400_response(self, msg: str) -> None:  # uvicorn's own refusals, in our shape
        self._refuse(400, "invalid HTTP request")

    # ------------------------------------------------------------------ the head's deadline
    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self._answering():  # a pipelined head is late: the answer before it runs on
            self._arm_head_deadline()
            return
        seconds = f"{self.limits.head_timeout_s:g}"
        if self._head_started:
            self._refuse(408, f"the request line and headers took over {seconds} s")
        else:
            self.transport.close()
            self.report(None, f"no request within {seconds} s", self._client_name())

    # ------------------------------------------------------------------ refusing
    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, message: str) -> None:
        """Answers ``status`` (unless an answer is already under way on this connection,
        which a second one would corrupt) and closes the connection."""
        if self.transport.is_closing():
            return
        self._disarm_head_deadline()
        if self._answering():
            self.transport.close()
            self.report(None, message, self._client_name())
            return
        body = _JSON.encode(error_body(ErrorCode.INVALID_REQUEST, message))
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
        self.report(status, message, self._client_name())

    def _client_name(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else ""


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: ``services.runtime.service.serve`` owns
    SIGINT/SIGTERM and stops the gateway like every other service."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(
    app: Any, metrics: GatewayMetrics, log: Any, limits: HttpLimits = HttpLimits()
) -> Server:
    """The gateway's HTTP server for ``app`` (not started: ``serve(sockets=[...])``). What
    the edge refuses is counted (route ``other``) and logged."""

    def report(status: int | None, reason: str, client: str) -> None:
        if status is not None:
            metrics.http_requests.labels(OTHER_ROUTE, str(status)).inc()
        log.info("http connection refused", status=status, reason=reason, client=client)

    protocol = type(
        "BoundedHttpTools", (BoundedHttpTools,), {"limits": limits, "report": staticmethod(report)}
    )
    config = uvicorn.Config(
        app,
        http=protocol,
        ws="none",
        timeout_keep_alive=limits.keep_alive_s,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    return Server(config)
