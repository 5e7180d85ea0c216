"""What the worker tells operators: core-pass metrics and per-request spans.

Metrics (published over NATS by the service, served on the gateway's ``/metrics``):

- ``rlt:core_passes_total``: passes of the shared core (one ``core_loop`` call each);
- ``rlt:rows_per_core_pass`` / ``rlt:tokens_per_core_pass``: how full each pass was (rows
  at different depths share a pass: continuous depth batching);
- ``rlt:worker_batch_execute_seconds``: time to run one batch;
- int4-delta only: ``rlt:kv_int4_open_tail_blocks`` (blocks open now, their tokens exact in
  a full-precision tail), ``rlt:kv_int4_tail_pool_blocks`` (tails allocated) and
  ``rlt:kv_int4_tail_reserve_blocks`` (what the KV accounting counts): a pool above its
  reserve grew into memory nothing counted.

Spans: one per request per stay on this worker, from the batch that loads it to the batch
that releases it, a child of the scheduler's span of the request (``Batch.traceparents``).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from messages.batch import Batch
from services.runtime.tracing import (
    ATTR_BATCH_SEQ,
    ATTR_REQUEST_ID,
    ATTR_SHARD,
    Span,
    Tracer,
    parse_traceparent,
)
from services.worker.kv_int4.store import TailPoolStats

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
EXECUTE_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip


class WorkerTelemetry:
    def __init__(self, shard: str | None = None) -> None:
        self.shard = shard
        self.tracer = Tracer("worker")
        self._spans: dict[str, Span] = {}
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.core_passes = Counter(
            "rlt:core_passes", "Passes of the shared recurrent core.", registry=r
        )
        self.rows_per_pass = Histogram(
            "rlt:rows_per_core_pass",
            "Rows (requests' tasks, at any depth) in one core pass.",
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            "rlt:tokens_per_core_pass",
            "Token positions in one core pass.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.execute = Histogram(
            "rlt:worker_batch_execute_seconds",
            "Time to execute one batch on the worker.",
            buckets=EXECUTE_BUCKETS,
            registry=r,
        )

    def watch_int4_tails(self, stats: Callable[[], TailPoolStats | None]) -> None:
        """Gauges of the int4-delta tail pool, read from ``stats`` when collected."""
        gauges = (
            ("rlt:kv_int4_open_tail_blocks", "Blocks open: tokens exact in a tail.", "open"),
            ("rlt:kv_int4_tail_pool_blocks", "Full-precision tail blocks allocated.", "pool"),
            ("rlt:kv_int4_tail_reserve_blocks", "Tail blocks KV accounting counts.", "reserved"),
        )
        for name, doc, field in gauges:
            gauge = Gauge(name, doc, registry=self.registry)
            gauge.set_function(lambda field=field: _tail_figure(stats(), field))

    def on_executed(self, passes: list[tuple[int, int]], execute_s: float) -> None:
        self.execute.observe(execute_s)
        if passes:
            self.core_passes.inc(len(passes))
        for rows, tokens in passes:
            self.rows_per_pass.observe(rows)
            self.tokens_per_pass.observe(tokens)

    def on_batch(self, batch: Batch) -> None:
        """Spans: requests released by this batch end, requests it loads begin."""
        for rid in batch.finished_request_ids:
            span = self._spans.pop(rid, None)
            if span is not None:
                span.end(**{"rlt.last_batch_seq": batch.seq})
        if not batch.traceparents:
            return
        for new in batch.new_requests:
            parent = parse_traceparent(batch.traceparents.get(new.request_id))
            if parent is None:
                continue
            old = self._spans.pop(new.request_id, None)
            if old is not None:  # reloaded without a release (a new epoch)
                old.end()
            self._spans[new.request_id] = self.tracer.start(
                "worker.request",
                parent,
                attributes={
                    ATTR_REQUEST_ID: new.request_id,
                    ATTR_BATCH_SEQ: batch.seq,
                    ATTR_SHARD: self.shard,
                    "rlt.num_prompt_tokens": len(new.prompt_token_ids),
                },
            )

    def end_all(self) -> None:
        """A new epoch or shutdown: the device state of every request is gone."""
        for span in self._spans.values():
            span.end()
        self._spans.clear()


def _tail_figure(stats: TailPoolStats | None, field: str) -> float:
    if stats is None:  # no runner yet
        return 0.0
    return float(getattr(stats, f"{field}_blocks"))
