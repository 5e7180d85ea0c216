"""One generation call's life, from the first NATS publish to the last byte, over a
``Backend`` (what the HTTP side needs from the NATS shell, ``service.py``).

The call's ``n`` choices run as ``n`` engine requests side by side, each with its own
stream of events. Every choice's first event is awaited before the HTTP status is chosen,
so a refusal (invalid request, overloaded, unavailable) is a proper 4xx/5xx with OpenAI's
error body rather than an error inside a 200 stream; then the answer goes out as one JSON
body or as server-sent events (``http_responses.py``), frames from ``stream.py``.

A client that goes away (the connection closes) aborts the call's requests at once, so
their KV is freed; the disconnect is watched on the ASGI ``receive`` channel, also while
the call waits for its first token. The call ends once: its response counted, its span
ended, one log line.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from messages.api import ErrorEvent, GenerateRequest, StreamEvent
from messages.errors import ErrorCode
from services.common.tokenizer import TextCodec
from services.gateway.errors import ApiError, status_of
from services.gateway.http_responses import (
    SseResponse,
    error_response,
    json_response,
    wait_disconnect,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import ChatRequest, CompletionRequest
from services.gateway.stream import (
    DONE_FRAME,
    Answer,
    Delta,
    SseEncoder,
    answers_body,
    combined_usage,
)
from services.gateway.translate import Options, choice_requests, to_generate
from services.runtime.logging import request_fields
from services.runtime.tracing import ATTR_REQUEST_ID, TRACEPARENT, Tracer, parse_traceparent


class EventStream(Protocol):
    async def next(self, timeout: float) -> StreamEvent: ...

    def next_nowait(self) -> StreamEvent | None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What the HTTP side needs from the service."""

    model_name: str
    created: int
    max_model_len: int
    codec: TextCodec | None  # the checkpoint's tokenizer: only to echo token-id prompts
    draining: bool
    request_timeout_s: float
    metrics: GatewayMetrics
    tracer: Tracer
    log: Any

    async def open_stream(
        self, request: GenerateRequest, traceparent: str, trace_id: str
    ) -> EventStream: ...

    def abort_soon(self, request_id: str, trace_id: str) -> None: ...

    async def readiness(self) -> tuple[bool, dict[str, Any]]: ...


@dataclass
class _Choice:
    """One of a request's ``n`` answers: an engine request and its stream of its own."""

    index: int
    generate: GenerateRequest
    answer: Answer
    stream: EventStream | None = None
    sent: bool = False  # its request went to the engine
    heard: bool = False  # its first event came
    aborted: bool = False

    @property
    def request_id(self) -> str:
        return self.answer.request_id


class Call:
    """One generation request, from the first NATS publish to the last byte. Its ``n``
    choices run as ``n`` engine requests side by side; one that fails fails the call (the
    others are aborted), as OpenAI answers a request whole or not at all."""

    def __init__(
        self,
        backend: Backend,
        req: CompletionRequest | ChatRequest,
        opts: Options,
        chat: bool,
        request: Request,
        started: float,
    ) -> None:
        self.backend = backend
        self.chat = chat
        self.scope = request.scope
        self.route = request.url.path
        self.started = started
        traceparent = request.headers.get(TRACEPARENT)
        self.options = opts
        self.request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        generate = to_generate(req, self.request_id, opts.tools)
        requests = choice_requests(generate, req.n or 1)
        self.choices = [
            _Choice(i, g, Answer(g.request_id or self.request_id, opts))
            for i, g in enumerate(requests)
        ]
        self.created = int(time.time())
        self.span = backend.tracer.start(
            "gateway.request",
            parse_traceparent(traceparent),
            attributes={ATTR_REQUEST_ID: self.request_id, "http.route": self.route},
        )
        self.deadline = time.monotonic() + backend.request_timeout_s
        self.events = _Events(self)
        self.status = 200
        self.closed = False

    @property
    def trace_id(self) -> str:
        return self.span.trace_id

    @property
    def answers(self) -> list[Answer]:
        return [c.answer for c in self.choices]

    def _failed(self) -> ErrorEvent | None:
        return next((a.error for a in self.answers if a.error is not None), None)

    async def run(self, receive: Receive) -> Response:
        gone = asyncio.ensure_future(wait_disconnect(receive))
        first: list[list[Delta]] = [[] for _ in self.choices]
        try:
            for choice in self.choices:
                choice.sent = True
                choice.stream = await self.backend.open_stream(
                    choice.generate, self.span.traceparent, self.trace_id
                )
            # every choice's first event before the status (a refusal is a 4xx/5xx), as
            # they come: one refused answers at once
            early = await self._read(gone, first, lambda c: not c.heard)
            if early is None and not self.options.stream:
                early = await self._read(gone, first, lambda c: not c.answer.engine_done)
            if early is not None:
                return early
            if not self.options.stream:
                self._finish()
                return json_response(
                    answers_body(
                        self.chat, self.request_id, self.backend.model_name, self.created,
                        self.answers,
                    )
                )  # fmt: skip
        except BaseException as exc:
            self._end_early(exc)
            raise
        finally:
            gone.cancel()
        model, opts = self.backend.model_name, self.options
        encoders = [
            SseEncoder(self.chat, self.request_id, model, self.created, opts, c.index, c.answer)
            for c in self.choices
        ]
        frames = b"".join(e.deltas(d) for e, d in zip(encoders, first, strict=True))
        return SseResponse(self._frames(encoders, frames), self._client_gone)

    async def _read(
        self,
        gone: asyncio.Future[None],
        deltas: list[list[Delta]],
        waiting: Callable[[_Choice], bool],
    ) -> Response | None:
        """Reads the choices ``waiting`` says are, as their events come, adding each one's
        deltas; the response when the call ends early (the client left, a choice failed)."""
        while live := [c for c in self.choices if waiting(c)]:
            got = await self.events.next(live, gone)
            if got is None:
                return self._client_gone()
            choice, event = got
            choice.heard = True
            deltas[choice.index] += choice.answer.on_event(event)
            if choice.answer.error is not None:
                return self._error_response(choice.answer.error)
            self._abort_if_stopped(choice)
        return None

    async def _frames(self, encoders: list[SseEncoder], first: bytes) -> AsyncIterator[bytes]:
        events = self.events
        try:
            if first:
                yield first
            live = [c for c in self.choices if not c.answer.done]
            while live:
                got = await events.next(live)
                assert got is not None  # no client to lose here: the response watches it
                choice, event = got
                answer = choice.answer
                deltas = answer.on_event(event)
                # events that are already here go out in the same write
                while not answer.done and (more := self._next_nowait(choice)) is not None:
                    deltas += answer.on_event(more)
                self._abort_if_stopped(choice)
                frames = encoders[choice.index].deltas(deltas)
                if frames:
                    yield frames
                if answer.error is not None:
                    break  # the call fails: the other choices are aborted below
                if answer.done:
                    live = [c for c in live if not c.answer.done]
            events.cancel()
            error = self._failed()
            if error is not None:
                self._abort_all()
                self.status = status_of(error.code)
                yield encoders[0].error(error.code, error.message)
            elif self.options.include_usage:
                for choice in self.choices:  # the prompt counts come with the last event
                    while not choice.answer.engine_done:
                        choice.answer.on_event(await self._next(choice))
                yield encoders[0].usage(combined_usage(self.answers))
            yield DONE_FRAME
            self._finish()
        except BaseException as exc:
            events.cancel()
            self._end_early(exc)
            raise

    async def _next(self, choice: _Choice) -> StreamEvent:
        assert choice.stream is not None
        remaining = self.deadline - time.monotonic()
        try:
            return await choice.stream.next(max(remaining, 0.0))
        except TimeoutError:
            self._abort(choice)
            return ErrorEvent(
                request_id=choice.request_id,
                code=str(ErrorCode.TIMEOUT),
                message=f"no answer within {self.backend.request_timeout_s:.0f}s",
            )

    def _next_nowait(self, choice: _Choice) -> StreamEvent | None:
        assert choice.stream is not None
        return choice.stream.next_nowait()

    def _abort_if_stopped(self, choice: _Choice) -> None:
        if choice.answer.needs_abort:
            self._abort(choice)

    def _abort(self, choice: _Choice) -> None:
        if choice.sent and not choice.aborted and not choice.answer.engine_done:
            choice.aborted = True
            self.backend.abort_soon(choice.request_id, self.trace_id)

    def _abort_all(self) -> None:
        for choice in self.choices:
            self._abort(choice)

    def _client_gone(self) -> Response:
        if self.status != 499:
            self._abort_all()
            self.backend.metrics.client_disconnects.inc()
            self.status = 499  # nginx's "client closed request": never sent, only logged
            self._finish()
        return Response(status_code=499)

    def _end_early(self, exc: BaseException) -> None:
        """Cancelled or failed mid-way: the engine must not run on for nobody."""
        if isinstance(exc, Exception) and not self.closed:
            self.status = 500  # what the error handler answers (or a stream broken off)
        self._abort_all()
        self._finish()

    def _error_response(self, event: ErrorEvent) -> Response:
        self._abort_all()  # the other choices: nobody will read them
        exc = ApiError(event.message, event.code)
        self.status = exc.status
        self._finish()
        return error_response(exc)

    def _finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.events.cancel()  # reads of closed streams would wait for nothing
        for choice in self.choices:
            if choice.stream is not None:
                choice.stream.close()
                choice.stream = None
        backend, first = self.backend, self.choices[0].answer
        backend.metrics.count_response(self.scope, self.route, self.status)
        error = self._failed()
        self.span.end(
            error=f"{error.code}: {error.message[:200]}" if error is not None else None,
            **{"http.status_code": self.status, "rlt.finish_reason": first.finish_reason},
        )
        backend.log.info(
            "http request",
            route=self.route,
            status=self.status,
            stream=self.options.stream,
            choices=len(self.choices),
            finish_reason=first.finish_reason,
            num_tokens=sum(len(a.token_ids) for a in self.answers),
            latency_s=round(time.monotonic() - self.started, 4),
            **request_fields(self.request_id, self.trace_id),
        )


class _Events:
    """The next event of any of the given choices, as they arrive (by index when several
    are in). One pending read per choice, kept across calls so that no event is lost; one
    choice and no client to watch (a stream's common case) awaits its stream directly."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._reads: dict[int, asyncio.Future[StreamEvent]] = {}

    async def next(
        self, live: list[_Choice], gone: asyncio.Future[None] | None = None
    ) -> tuple[_Choice, StreamEvent] | None:
        """None: ``gone`` (the client went away) came first."""
        if gone is None and len(live) == 1 and not self._reads:  # no task per event
            return live[0], await self._call._next(live[0])
        for choice in live:
            if choice.index not in self._reads:
                self._reads[choice.index] = asyncio.ensure_future(self._call._next(choice))
        waits: list[asyncio.Future[Any]] = [self._reads[c.index] for c in live]
        if gone is not None:
            waits.append(gone)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        ready = [c.index for c in live if self._reads[c.index].done()]
        if not ready:
            return None
        index = min(ready)
        return self._call.choices[index], self._reads.pop(index).result()

    def cancel(self) -> None:
        for read in self._reads.values():
            read.cancel()
        self._reads.clear()
