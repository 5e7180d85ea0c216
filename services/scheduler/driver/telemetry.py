"""What the scheduler tells operators: Prometheus metrics and per-request spans.

``SchedulerTelemetry`` is fed by ``SchedulerDriver`` at four points (a request added, a
batch built, a worker result, the events routed to clients) and never changes scheduling.
Its registry is published over NATS by the service (``services/runtime/metrics.py``) and
served, with every other instance's, on the gateway's ``/metrics``.

Names follow vLLM's under ``rlt:`` (dashboards and benchmark tools know them); timings are
measured here, from the request's arrival at the scheduler:

- ``rlt:time_to_first_token_seconds``: arrival -> first token event;
- ``rlt:inter_token_latency_seconds``: between consecutive token events of a request;
- ``rlt:e2e_request_latency_seconds``: arrival -> terminal event;
- ``rlt:request_queue_time_seconds``: arrival -> the first batch that loads the request;
- ``rlt:prefix_cache_queries_total`` / ``_hits_total``: prompt tokens looked up / found,
  each time a request is (re)admitted with prefix caching on;
- ``rlt:num_preemptions_total``: recompute preemptions, including the requeues after a
  lost worker;
- ``rlt:prefix_inflight_waits_total``: waiting requests parked on a prompt block a running
  prefill was computing (in-flight prefix sharing), once per block waited for;
- ``rlt:admission_bypasses_total`` / ``rlt:admission_backfills_total``: requests started
  ahead of one the KV policy refused, as counted passes and as backfills.

Looped-model metrics (a loop = one pass of the shared core for one token):

- ``rlt:exit_depth``: histogram of the loops each generated token ran (1..total_ut_steps);
- ``rlt:decode_core_loops_total``: their sum; ``rlt:loops_saved_total``: total_ut_steps minus
  each token's exit depth, summed (what early exit saved against full depth);
- ``rlt:depth_budget``: the loops a new generated token may run now (total_ut_steps unless
  ``--overload-policy shed-depth`` lowered it under a long queue);
  ``rlt:shed_tokens_total``: generated tokens that ran under a lowered budget;
- ``rlt:prefill_rows_total``: hidden-state rows the prompts' loops computed (token x
  loop); ``rlt:prefill_rows_saved_total``: the rows token-sparse prefill's frozen tokens
  did not compute (what it saved against dense prefill);
- ``rlt:wasted_follow_on_rows_total``: follow-on rows sent for a request that finished
  before they ran (async scheduling's speculation that did not pay);
- ``rlt:bus_overhead_seconds``: per batch, the round trip scheduler -> worker -> scheduler
  minus the time the batch spent at the worker (NATS and codec cost of one step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from messages.batch import RowKind
from messages.internal import AdmittedRequest, WorkerResult
from services.runtime.tracing import (
    ATTR_BATCH_SEQ,
    ATTR_REQUEST_ID,
    ATTR_SHARD,
    Span,
    Tracer,
    parse_traceparent,
)
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.scheduler import Scheduler

# seconds; fine at the low end, where a CPU toy model and a GPU decode step both live
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BUS_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5,
)  # fmt: skip


@dataclass
class _Timing:
    arrived: float
    span: Span
    last_token: float | None = None
    queued: bool = True  # not yet in any batch


class _LiveState(Collector):
    """Gauges and counters read from the scheduler when scraped (the published text)."""

    # counters read from SchedulerStats: (field, metric name, help)
    _COUNTERS = (
        (
            "num_preemptions",
            "rlt:num_preemptions",
            "Recompute preemptions (requeues after a lost worker included).",
        ),
        (
            "num_prefix_deferrals",
            "rlt:prefix_inflight_waits",
            "Waiting requests parked on a prompt block a running prefill was computing.",
        ),
        (
            "num_admission_bypasses",
            "rlt:admission_bypasses",
            "Requests started ahead of a waiting request the KV policy refused, counted "
            "against its --max-admission-bypasses.",
        ),
        (
            "num_admission_backfills",
            "rlt:admission_backfills",
            "Requests started ahead of a waiting request the KV policy refused, estimated to "
            "finish before it could start (not counted).",
        ),
        (
            "num_shed_tokens",
            "rlt:shed_tokens",
            "Generated tokens that ran under a depth budget overload shedding lowered.",
        ),
        (
            "num_prefill_rows",
            "rlt:prefill_rows",
            "Hidden-state rows the prompts' loops computed (token x loop).",
        ),
        (
            "num_prefill_rows_saved",
            "rlt:prefill_rows_saved",
            "Prompt rows token-sparse prefill did not compute (frozen tokens of sparse loops).",
        ),
    )

    def __init__(self, scheduler: Callable[[], Scheduler]) -> None:
        self._scheduler = scheduler
        # a reset driver builds a new Scheduler whose stats start at 0: keep counting up
        self._before = dict.fromkeys((f for f, _, _ in self._COUNTERS), 0)
        self._last_stats: object = None
        self._last = dict(self._before)

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self._scheduler()
        if s.stats is not self._last_stats:
            for name, last in self._last.items():
                self._before[name] += last
            self._last_stats = s.stats
        for name in self._last:
            self._last[name] = getattr(s.stats, name)
        kv = s.kv
        yield GaugeMetricFamily(
            "rlt:num_requests_running", "Requests in the running set.", value=len(s.running)
        )
        yield GaugeMetricFamily(
            "rlt:num_requests_waiting", "Requests waiting to be scheduled.", value=s.num_waiting()
        )
        yield GaugeMetricFamily(
            "rlt:kv_cache_usage_perc",
            "Fraction of KV blocks held by requests (1 = full; cached but unreferenced "
            "blocks count as free).",
            value=1.0 - kv.num_free_blocks / kv.num_blocks if kv.num_blocks else 0.0,
        )
        yield GaugeMetricFamily(
            "rlt:depth_budget",
            "Loops a new generated token may run (total_ut_steps unless overload shedding "
            "lowered it; each request's min_loops and max_loops still bound its tokens).",
            value=s.depth_budget,
        )
        for name, metric, doc in self._COUNTERS:
            yield CounterMetricFamily(metric, doc, value=self._before[name] + self._last[name])


class SchedulerTelemetry:
    def __init__(
        self,
        scheduler: Callable[[], Scheduler],
        *,
        total_ut_steps: int,
        prefix_caching: bool,
        shard: str | None = None,
    ) -> None:
        self.total_ut_steps = total_ut_steps
        self.prefix_caching = prefix_caching
        self.shard = shard
        self.tracer = Tracer("scheduler")
        self._timings: dict[str, _Timing] = {}
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_LiveState(scheduler))
        self.ttft = Histogram(
            "rlt:time_to_first_token_seconds",
            "Arrival at the scheduler to the first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "rlt:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "rlt:e2e_request_latency_seconds",
            "Arrival at the scheduler to the request's terminal event.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "rlt:request_queue_time_seconds",
            "Arrival at the scheduler to the first batch that loads the request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "rlt:request_success",
            "Requests that finished, by finish reason (stop, length, abort).",
            ["finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "rlt:request_errors",
            "Requests that ended with an error, by code.",
            ["code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rlt:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "rlt:generation_tokens", "Generated tokens streamed to clients.", registry=r
        )
        self.prefix_queries = Counter(
            "rlt:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (each admission).",
            registry=r,
        )
        self.prefix_hits = Counter(
            "rlt:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.exit_depth = Histogram(
            "rlt:exit_depth",
            "Loops each generated token ran before it exited (1..total_ut_steps).",
            buckets=tuple(float(d) for d in range(1, total_ut_steps + 1)),
            registry=r,
        )
        self.decode_loops = Counter(
            "rlt:decode_core_loops", "Core loops spent on generated tokens.", registry=r
        )
        self.loops_saved = Counter(
            "rlt:loops_saved",
            "Loops early exit saved against full depth (total_ut_steps - exit depth).",
            registry=r,
        )
        self.wasted_follow_ons = Counter(
            "rlt:wasted_follow_on_rows",
            "Follow-on rows sent for a request that finished before they ran.",
            registry=r,
        )
        self.bus_overhead = Histogram(
            "rlt:bus_overhead_seconds",
            "Per batch: round trip to the worker minus the time the batch spent there.",
            buckets=BUS_BUCKETS,
            registry=r,
        )

    # ------------------------------------------------------------------ hooks
    def on_added(self, req: AdmittedRequest, traceparent: str = "") -> None:
        span = self.tracer.start(
            "scheduler.request",
            parse_traceparent(traceparent),
            trace_id=req.trace_id or None,
            attributes={
                ATTR_REQUEST_ID: req.request_id,
                ATTR_SHARD: self.shard,
                "rlt.num_prompt_tokens": len(req.prompt_token_ids),
            },
        )
        self._timings[req.request_id] = _Timing(time.monotonic(), span)

    def handed_off(self, request_id: str) -> str:
        """The request left for a decode shard after its first token: its span here ends;
        returns the span's traceparent (the decode side's pull is its child)."""
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return ""
        traceparent = timing.span.traceparent
        timing.span.end(**{"rlt.handed_off": True})
        return traceparent

    def on_batch(self, batch: ScheduledBatch, scheduler: Scheduler) -> None:
        """A batch was built: requests it loads leave the queue."""
        wire = batch.wire
        if not wire.new_requests:
            return
        now = time.monotonic()
        traceparents: dict[str, str] = {}
        for new in wire.new_requests:
            rid = new.request_id
            if self.prefix_caching:
                request = scheduler.requests.get(rid)
                if request is not None:
                    self.prefix_queries.inc(request.num_prompt_tokens)
                    self.prefix_hits.inc(request.num_cached_tokens)
            timing = self._timings.get(rid)
            if timing is None:
                continue
            if timing.queued:  # a readmission after preemption is not queue time again
                timing.queued = False
                self.queue_time.observe(now - timing.arrived)
                timing.span.set(ATTR_BATCH_SEQ, wire.seq)
            if timing.span.recording:
                traceparents[rid] = timing.span.traceparent
        if traceparents:
            # the worker's span of each request it loads is a child of ours
            wire.traceparents = {**wire.traceparents, **traceparents}

    def on_result(self, wr: WorkerResult, round_trip_s: float | None) -> None:
        """``round_trip_s``: from sending the batch to its result (None: not timed)."""
        if round_trip_s is None:
            return
        at_worker = wr.worker_s or wr.execute_s
        self.bus_overhead.observe(max(round_trip_s - at_worker, 0.0))

    def on_events(self, events: Iterable[StreamEvent], inflight: Sequence[ScheduledBatch]) -> None:
        """Events routed to live streams (each exactly once)."""
        now = time.monotonic()
        for event in events:
            if isinstance(event, TokenEvent):
                self._on_token(event, now)
            else:
                self._on_terminal(event, now, inflight)

    # ------------------------------------------------------------------ events
    def _on_token(self, event: TokenEvent, now: float) -> None:
        self.generation_tokens.inc()
        depth = event.exit_depth
        self.exit_depth.observe(depth)
        self.decode_loops.inc(depth)
        self.loops_saved.inc(max(self.total_ut_steps - depth, 0))
        timing = self._timings.get(event.request_id)
        if timing is None:
            return
        if timing.last_token is None:
            self.ttft.observe(now - timing.arrived)
        else:
            self.itl.observe(now - timing.last_token)
        timing.last_token = now

    def _on_terminal(
        self, event: StreamEvent, now: float, inflight: Sequence[ScheduledBatch]
    ) -> None:
        rid = event.request_id
        wasted = sum(
            1
            for batch in inflight
            if not batch.outputs_applied
            for task in batch.tasks
            if task.kind is RowKind.FOLLOW_ON and task.request.request_id == rid
        )
        if wasted:
            self.wasted_follow_ons.inc(wasted)
        timing = self._timings.pop(rid, None)
        if isinstance(event, FinishedEvent):
            self.success.labels(event.finish_reason).inc()
            self.prompt_tokens.inc(event.num_prompt_tokens)
            if timing is not None:
                timing.span.end(
                    **{
                        "rlt.finish_reason": event.finish_reason,
                        "rlt.num_tokens": len(event.token_ids),
                        "rlt.num_cached_tokens": event.num_cached_tokens,
                    }
                )
        elif isinstance(event, ErrorEvent):
            self.errors.labels(event.code).inc()
            if timing is not None:
                timing.span.end(error=f"{event.code}: {event.message[:200]}")
        if timing is not None:
            self.e2e.observe(now - timing.arrived)
