"""The worker's part in prefill/decode disaggregation, off the event loop.

As a source (prefill role) it registers each runner's KV arenas with its NIXL agent and
tells peers where they are (``KVSourceInfo``, on ``rlt.v1.worker.kvmeta.<worker>``). As a
destination (decode role) it runs the pulls a batch carries: the source's description is
fetched when the batch arrives (in seq order, before the batch is queued), and the reads
start when the batch reaches the front of the queue (every earlier batch has run, so
nothing of a block's previous owner still writes it) and run on the transfer thread while
later batches compute. Each outcome goes back to the scheduler (``KVPullResult``) with the
bytes and seconds it took. Every NIXL call runs on one thread, with a deadline: the event
loop never waits for a transfer, and no transfer waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from messages.kv_transfer import KVPull, KVPullResult, KVSourceInfo
from services.common.config import KVLayout
from services.runtime.tracing import ATTR_REQUEST_ID, ATTR_SHARD, Tracer, parse_traceparent
from services.worker import kv_transfer as kvt
from services.worker.kv_transfer import KVArena, KVTransferAgent, TransferError

# a source's description comes over NATS; past this the pull fails (source_lost)
META_TIMEOUT_S = 2.0
TRANSFER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

# fetches a worker's KVSourceInfo (None: nobody answered)
FetchSource = Callable[[str, float], Awaitable[KVSourceInfo | None]]


def arena_of(runner: Any) -> KVArena | None:
    """The K/V arenas of a ``ModelRunner`` or a ``SimRunner`` (None: it has none)."""
    arena = getattr(runner, "kv_arena", None)
    if arena is not None:
        return arena
    k, v = getattr(runner, "k_cache", None), getattr(runner, "v_cache", None)
    return KVArena(k, v) if k is not None and v is not None else None


def num_planes(kv_layout: str, total_loops: int) -> int:
    return total_loops if KVLayout(kv_layout) == KVLayout.LAST_EXITED else 1


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter(
            "rlt:kv_transfer_bytes", "Bytes of KV pulled from prefill workers.", registry=registry
        )
        self.seconds = Histogram(
            "rlt:kv_transfer_seconds",
            "Time to pull one request's prompt KV (NIXL READ, every plane and layer).",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            "rlt:kv_transfer_failures",
            "KV pulls that failed, by cause (the request is prefilled again here).",
            ["cause"],
            registry=registry,
        )


class KVPulls:
    def __init__(
        self,
        worker_id: str,
        total_loops: int,
        fetch_source: FetchSource,
        registry: CollectorRegistry,
        log: Any,
        shard: str = "",
    ) -> None:
        self.worker_id = worker_id
        self.total_loops = total_loops
        self._fetch_source = fetch_source
        self.log = log
        self.shard = shard
        self.metrics = KVTransferMetrics(registry)
        self.tracer = Tracer("worker")
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlt-kv")
        self._agent: KVTransferAgent | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sources: dict[str, KVSourceInfo] = {}
        self._fetch_errors: dict[str, TransferError] = {}  # transfer id -> why, until it runs
        self._registered: Any = None  # (runner, epoch) whose arenas are registered
        # (epoch, result) for the service to send to that epoch's scheduler
        self.results: asyncio.Queue[tuple[str, KVPullResult]] = asyncio.Queue()
        self.num_pulls = self.num_failed = 0
        self.num_bytes = 0
        # (bytes, seconds) of the latest pulls that succeeded (health: percentiles, GB/s)
        self.recent: deque[tuple[int, float]] = deque(maxlen=1000)

    async def start(self) -> None:
        """Creates the NIXL agent (on the transfer thread: it takes a while)."""
        self._loop = asyncio.get_running_loop()
        self._agent = await self._loop.run_in_executor(
            self._thread, KVTransferAgent, f"rlt-worker-{self.worker_id}"
        )

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self._agent is not None:
            self._agent.deregister()

    async def source_info(self) -> KVSourceInfo:
        """Our description for a peer (after every registration queued before it)."""
        assert self._loop is not None and self._agent is not None
        return await self._loop.run_in_executor(self._thread, self._agent.source_info)

    async def prepare(self, pulls: list[KVPull]) -> None:
        """On the event loop, as their batch arrives: each pull's source description, from
        the cache or its worker; a pull whose source cannot be described fails when run."""
        for pull in pulls:
            known = self._sources.get(pull.worker_id)
            if known is None or known.epoch != pull.worker_epoch:
                try:
                    info = await self._fetch_source(pull.worker_id, META_TIMEOUT_S)
                except Exception as exc:  # the bus said no: no such worker any more
                    info = None
                    self.log.warning("KV source unreachable", error=repr(exc)[:200])
                if info is not None and not info.error:
                    self._sources[pull.worker_id] = known = info
                elif info is not None:
                    self._fetch_errors[pull.transfer_id] = TransferError(kvt.ERROR, info.error)
                    continue
            if known is None:
                why = f"worker {pull.worker_id} did not describe its KV"
                self._fetch_errors[pull.transfer_id] = TransferError(kvt.SOURCE_LOST, why)
            elif known.epoch != pull.worker_epoch:
                why = f"worker {pull.worker_id} is at epoch {known.epoch}, not {pull.worker_epoch}"
                self._fetch_errors[pull.transfer_id] = TransferError(kvt.SOURCE_RESET, why)

    def before_batch(self, runner: Any, epoch: str, kv_layout: str, pulls: list[KVPull]) -> None:
        """On the compute thread (or the loop) just before a batch runs: (re)registers the
        runner's arenas, then starts the batch's pulls on the transfer thread."""
        if self._agent is None:
            for pull in pulls:
                why = TransferError(kvt.UNAVAILABLE, "this worker has no KV transfer agent")
                self._finish(epoch, pull, why, 0, 0.0)
            return
        if (runner, epoch) != self._registered:
            arena = arena_of(runner)
            if arena is not None:
                self._registered = (runner, epoch)
                layout = arena.layout(kv_layout, num_planes(kv_layout, self.total_loops))
                self._thread.submit(self._agent.register, arena, epoch, layout)
        for pull in pulls:
            self._thread.submit(self._run_pull, epoch, pull)

    def _run_pull(self, epoch: str, pull: KVPull) -> None:
        """On the transfer thread."""
        assert self._agent is not None
        t0 = time.perf_counter()
        error = self._fetch_errors.pop(pull.transfer_id, None)
        moved = 0
        if error is None:
            source = self._sources.get(pull.worker_id)
            try:
                if source is None:
                    raise TransferError(kvt.SOURCE_LOST, f"worker {pull.worker_id} is unknown")
                moved = self._agent.read(
                    source, pull.remote_blocks, pull.local_blocks, pull.timeout_s
                )
            except TransferError as exc:
                error = exc
            except Exception as exc:  # never let one pull end the thread
                error = TransferError(kvt.ERROR, repr(exc)[:300])
            if error is not None and error.cause == kvt.SOURCE_LOST:
                self._sources.pop(pull.worker_id, None)
                if source is not None:
                    self._agent.forget(source.agent_name)
        self._finish(epoch, pull, error, moved, time.perf_counter() - t0)

    def _finish(
        self, epoch: str, pull: KVPull, error: TransferError | None, moved: int, seconds: float
    ) -> None:
        result = KVPullResult(
            transfer_id=pull.transfer_id,
            request_id=pull.request_id,
            ok=error is None,
            cause="" if error is None else error.cause,
            message="" if error is None else str(error)[:300],
            num_bytes=moved,
            seconds=seconds,
        )
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
            self._loop.call_soon_threadsafe(self._report, epoch, pull, result)

    def _report(self, epoch: str, pull: KVPull, result: KVPullResult) -> None:
        """On the event loop: metrics, the span, the log line, and the result queued."""
        self.num_pulls += 1
        if result.ok:
            self.num_bytes += result.num_bytes
            self.metrics.bytes.inc(result.num_bytes)
            self.metrics.seconds.observe(result.seconds)
            self.recent.append((result.num_bytes, result.seconds))
        else:
            self.num_failed += 1
            self.metrics.failures.labels(cause=result.cause).inc()
        parent = parse_traceparent(pull.traceparent)
        if parent is not None:
            span = self.tracer.start(
                "worker.kv_transfer",
                parent,
                attributes={
                    ATTR_REQUEST_ID: pull.request_id,
                    ATTR_SHARD: self.shard,
                    "rlt.kv_source_worker": pull.worker_id,
                    "rlt.kv_bytes": result.num_bytes,
                    "rlt.kv_blocks": len(pull.local_blocks),
                },
            )
            span.end(error=None if result.ok else f"{result.cause}: {result.message}")
        fields = {
            "request_id": pull.request_id,
            "transfer_id": pull.transfer_id,
            "bytes": result.num_bytes,
            "ms": round(result.seconds * 1e3, 3),
        }
        if result.ok:
            self.log.info("KV pulled", **fields)
        else:
            self.log.warning("KV pull failed", cause=result.cause, error=result.message, **fields)
        self.results.put_nowait((epoch, result))

    def health(self) -> dict[str, Any]:
        return {
            "kv_pulls": self.num_pulls,
            "kv_pulls_failed": self.num_failed,
            "kv_bytes_pulled": self.num_bytes,
            "kv_sources_known": len(self._sources),
            "kv_recent_pulls": [list(p) for p in self.recent],
        }
