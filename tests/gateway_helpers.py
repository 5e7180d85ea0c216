"""Helpers for the gateway tests: a request body, a real gateway service on a NATS server,
scraping /metrics into sums, reading a completion's tokens back as a FinishedEvent (for the
oracle comparison), and a scripted backend the HTTP app runs over without NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from messages.api import FinishedEvent, GenerateRequest, StreamEvent, TokenEvent
from services.gateway.app import build_app
from services.gateway.auth import ApiKeys
from services.gateway.edge import HttpLimits, http_server
from services.gateway.metrics import GatewayMetrics
from services.gateway.process import bind_http
from services.gateway.service import GatewayService
from services.runtime.logging import get_logger
from services.runtime.tracing import Tracer


def json_body(**fields: object) -> bytes:
    """A request body for the served model (``toy``) with ``fields``."""
    return json.dumps({"model": "toy", **fields}).encode()


# labels that say where a sample came from: summed over, as `sum by (...)` would
_WHERE = {"instance", "service", "model_name", "shard"}

# the metrics the gateway must expose, by their exposed sample names
REQUIRED_METRICS = (
    "rlt:num_requests_running",
    "rlt:num_requests_waiting",
    "rlt:kv_cache_usage_perc",
    "rlt:prefix_cache_queries_total",
    "rlt:prefix_cache_hits_total",
    "rlt:time_to_first_token_seconds_count",
    "rlt:inter_token_latency_seconds_count",
    "rlt:e2e_request_latency_seconds_count",
    "rlt:request_queue_time_seconds_count",
    "rlt:request_success_total",
    "rlt:num_preemptions_total",
    # looped-model metrics
    "rlt:exit_depth_count",
    "rlt:core_passes_total",
    "rlt:rows_per_core_pass_count",
    "rlt:loops_saved_total",
    "rlt:wasted_follow_on_rows_total",
    "rlt:bus_overhead_seconds_count",
)


def metric_sums(text: str) -> dict[str, float]:
    """``name{label="v",...}`` -> value summed over instances; plain ``name`` -> the sum of
    every series of that sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in _WHERE}
            out[s.name] = out.get(s.name, 0.0) + s.value
            if labels:
                key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def as_finished(choice: dict[str, Any], usage: dict[str, Any], request_id: str) -> FinishedEvent:
    """A completion (``return_token_ids``) as the NATS API's finished event."""
    return FinishedEvent(
        request_id=request_id,
        finish_reason=choice["finish_reason"],
        token_ids=list(choice["token_ids"]),
        exit_depths=list(choice["exit_depths"]),
        num_prompt_tokens=usage["prompt_tokens"],
        num_cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


# ---------------------------------------------------------------------- a scripted backend
class ScriptedStream:
    """A stream that hands out the events its script gives the request, then waits. A
    script may also give a coroutine function, which feeds the stream as it likes."""

    def __init__(self, events: Any) -> None:
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.feeder: asyncio.Task[None] | None = None
        if callable(events):
            self.feeder = asyncio.ensure_future(events(self.queue.put_nowait))
            return
        for event in events:
            self.queue.put_nowait(event)

    async def next(self, timeout: float) -> StreamEvent:
        return await asyncio.wait_for(self.queue.get(), timeout)

    def next_nowait(self) -> StreamEvent | None:
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        pass


class ScriptedBackend:
    """What the HTTP side needs, with each engine request's events from ``script``; an
    abort ends its stream as the engine does (``finished``, reason ``abort``)."""

    model_name = "toy"
    created = 0
    max_model_len = 2048
    codec = None
    draining = False
    request_timeout_s = 5.0

    def __init__(self, script: Any, fail_open: int | None = None) -> None:
        self.script = script
        self.fail_open = fail_open  # opening this choice's stream raises
        self.metrics = GatewayMetrics("toy")
        self.tracer = Tracer("gateway")
        self.log = get_logger("gateway")
        self.sent: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.abort_seen: dict[int, asyncio.Event] = {}  # by choice index
        self._streams: dict[str, ScriptedStream] = {}

    def aborted_event(self, index: int) -> asyncio.Event:
        return self.abort_seen.setdefault(index, asyncio.Event())

    async def open_stream(self, request: GenerateRequest, traceparent: str, trace_id: str):
        assert request.request_id is not None
        if self.fail_open is not None and choice_index(request.request_id) == self.fail_open:
            raise ConnectionError("the bus went away")
        self.sent.append(request)
        stream = self._streams[request.request_id] = ScriptedStream(self.script(request))
        return stream

    def abort_soon(self, request_id: str, trace_id: str) -> None:
        self.aborted.append(request_id)
        self.aborted_event(choice_index(request_id)).set()
        if (stream := self._streams.get(request_id)) is not None:
            stream.queue.put_nowait(
                FinishedEvent(request_id=request_id, finish_reason="abort", token_ids=[],
                              exit_depths=[], num_prompt_tokens=3, text="")
            )  # fmt: skip

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        return True, {}


def token_events(rid: str, texts: list[str], finish: bool = True) -> list[StreamEvent]:
    events: list[StreamEvent] = [
        TokenEvent(request_id=rid, index=i, token_id=10 + i, exit_depth=2, text=t)
        for i, t in enumerate(texts)
    ]
    if finish:
        events.append(
            FinishedEvent(
                request_id=rid,
                finish_reason="length",
                token_ids=[10 + i for i in range(len(texts))],
                exit_depths=[2] * len(texts),
                num_prompt_tokens=3,
                text="".join(texts),
            )
        )
    return events


def choice_index(rid: str) -> int:
    """Which choice an engine request id names (``<id>-<i>``); 0 for a request of one."""
    tail = rid.rsplit("-", 1)[1]
    return int(tail) if tail.isdigit() else 0


@contextlib.asynccontextmanager
async def http_served(
    backend: Any,
    limits: HttpLimits | None = None,
    api_keys: Sequence[str] = (),
    metrics_api_keys: Sequence[str] = (),
) -> AsyncIterator[str]:
    """The gateway's app over ``backend``, served on a loopback port by the gateway's own
    HTTP server (``edge.py``) in this event loop; yields its base URL."""
    app = build_app(backend, ApiKeys(api_keys), ApiKeys(metrics_api_keys))
    server = http_server(app, backend.metrics, backend.log, limits or HttpLimits())
    sock = bind_http("127.0.0.1", 0)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@contextlib.asynccontextmanager
async def gateway_up(
    nats_url: str, checkpoint: Path, **options: Any
) -> AsyncIterator[httpx.AsyncClient]:
    gateway = GatewayService(nats_url, checkpoint, port=0, served_model_name="toy", **options)
    await gateway.start()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{gateway.port}", timeout=60
        ) as http:
            yield http
    finally:
        await gateway.stop(drain_timeout=5.0)
