"""W3C trace context across the services, and optional OpenTelemetry spans.

A caller's ``traceparent`` header (``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``,
https://www.w3.org/TR/trace-context/) is accepted by the gateway (HTTP) and by admission (a
NATS header on ``rlt.v1.generate``). Its trace id becomes the request's ``trace_id``, which
every service logs, so the caller's trace id finds the request in every log. Each hop sends
the next one a ``traceparent`` naming its own span as the parent.

Spans are exported only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (OTLP over HTTP, with
the ``otel`` extra installed) or a test installs an exporter (``install_exporter``). Without
either, a ``Span`` is a plain value that only carries the context forward: no OpenTelemetry
import, no cost beyond formatting one header.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Any

# the header name, as W3C spells it (NATS headers are case-sensitive: always lower case)
TRACEPARENT = "traceparent"
# span attribute names every service uses
ATTR_REQUEST_ID = "rlt.request_id"
ATTR_BATCH_SEQ = "rlt.batch_seq"
ATTR_SHARD = "rlt.shard"

_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True, slots=True)
class TraceContext:
    """Where a hop sits in a trace: the trace id and the span that is its parent."""

    trace_id: str  # 32 lower-case hex digits
    span_id: str  # 16 lower-case hex digits
    sampled: bool = True

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def parse_traceparent(value: str | None) -> TraceContext | None:
    """The context a ``traceparent`` header names, or None when it is absent or invalid
    (W3C: an invalid header is ignored and a new trace starts)."""
    if not value:
        return None
    m = _TRACEPARENT_RE.match(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    # version ff is forbidden; version 00 has no trailing fields (later versions may)
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceContext(trace_id, span_id, sampled=bool(int(flags, 16) & 1))


def new_trace_id() -> str:
    return secrets.token_hex(16)


def new_span_id() -> str:
    return secrets.token_hex(8)


def is_trace_id(value: str) -> bool:
    return len(value) == 32 and value != _ZERO_TRACE and all(c in "0123456789abcdef" for c in value)


class Span:
    """A hop's span. ``context`` is what the next hop gets as its parent. Without an
    exporter it is only that context (the parent's span id passed on unchanged)."""

    def __init__(self, context: TraceContext, otel_span: Any = None) -> None:
        self.context = context
        self._otel = otel_span

    @property
    def trace_id(self) -> str:
        return self.context.trace_id

    @property
    def traceparent(self) -> str:
        return self.context.traceparent

    @property
    def recording(self) -> bool:
        return self._otel is not None

    def set(self, key: str, value: Any) -> None:
        if self._otel is not None and value is not None:
            self._otel.set_attribute(key, value)

    def end(self, error: str | None = None, **attributes: Any) -> None:
        otel = self._otel
        if otel is None:
            return
        self._otel = None  # ending twice is harmless
        for key, value in attributes.items():
            if value is not None:
                otel.set_attribute(key, value)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            otel.set_status(Status(StatusCode.ERROR, error))
        otel.end()


class Tracer:
    """One service's spans. ``start`` continues the trace of ``parent`` (or of
    ``trace_id``, or starts a new one) and returns the hop's span."""

    def __init__(self, service: str) -> None:
        self.service = service

    def start(
        self,
        name: str,
        parent: TraceContext | None = None,
        *,
        trace_id: str | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Span:
        otel = _otel_tracer(self.service)
        if otel is None:
            if parent is not None:
                return Span(parent)
            return Span(TraceContext(trace_id or new_trace_id(), new_span_id()))
        return _start_otel_span(otel, name, parent, trace_id, attributes or {})


# ---------------------------------------------------------------------- OpenTelemetry
_lock = threading.Lock()
_processors: list[Any] | None = None  # None: not decided yet; []: tracing off
_providers: dict[str, Any] = {}


def _span_processors() -> list[Any]:
    """Decided once per process: an OTLP exporter when the standard variable asks for one."""
    global _processors
    if _processors is None:
        _processors = []
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        ):
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
                from opentelemetry.sdk.trace.export import BatchSpanProcessor
            except ImportError:
                from services.runtime.logging import get_logger

                get_logger("tracing").error(
                    "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK or OTLP "
                    "exporter is not installed (pip install 'rlt[otel]'); spans are not exported"
                )
            else:
                _processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    return _processors


def install_exporter(exporter: Any, *, batch: bool = False) -> None:
    """Exports every service's spans of this process to ``exporter`` (tests pass an
    ``InMemorySpanExporter``). Replaces what the environment configured."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    global _processors
    with _lock:
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        _processors = [processor]
        _providers.clear()


def uninstall_exporters() -> None:
    """Back to no tracing (tests)."""
    global _processors
    with _lock:
        for provider in _providers.values():
            provider.shutdown()
        _providers.clear()
        _processors = []


def _otel_tracer(service: str) -> Any:
    processors = _span_processors()
    if not processors:
        return None
    provider = _providers.get(service)
    if provider is None:
        with _lock:
            provider = _providers.get(service)
            if provider is None:
                from opentelemetry.sdk.resources import Resource
                from opentelemetry.sdk.trace import TracerProvider

                # one provider per service, so each span says which service it came from
                # even when several run in one process (`rlt up`)
                provider = TracerProvider(
                    resource=Resource.create({"service.name": f"rlt-{service}"})
                )
                for processor in processors:
                    provider.add_span_processor(processor)
                _providers[service] = provider
    return provider.get_tracer("rlt")


def _start_otel_span(
    tracer: Any,
    name: str,
    parent: TraceContext | None,
    trace_id: str | None,
    attributes: dict[str, Any],
) -> Span:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    if parent is None and trace_id is not None and is_trace_id(trace_id):
        # keep a trace id chosen upstream (e.g. admission's) without a parent span: a remote
        # context that names no real span, so the trace ids agree
        parent = TraceContext(trace_id, new_span_id())
    context = None
    if parent is not None:
        remote = SpanContext(
            trace_id=int(parent.trace_id, 16),
            span_id=int(parent.span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED if parent.sampled else 0),
        )
        context = trace.set_span_in_context(NonRecordingSpan(remote))
    otel_span = tracer.start_span(
        name, context=context, attributes={k: v for k, v in attributes.items() if v is not None}
    )
    sc = otel_span.get_span_context()
    own = TraceContext(
        format(sc.trace_id, "032x"), format(sc.span_id, "016x"), sampled=sc.trace_flags.sampled
    )
    return Span(own, otel_span if otel_span.is_recording() else None)
