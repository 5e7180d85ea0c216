"""The worker's part in prefill/decode disaggregation, off the event loop.

As a source (prefill role) it registers each runner's KV arenas with its NIXL agent and
tells peers where they are (``KVSourceInfo``, on ``rlt.v1.worker.kvmeta.<worker>``). As a
destination (decode role) it runs the pulls a batch carries: the source's description is
asked for when the batch arrives (a task of its own: the batch is queued meanwhile), and
a pull is handed to the transfer thread (``pull_queue.py``) when its batch reaches the
front of the queue (every earlier batch has run, so nothing of a block's previous owner
still writes it); it moves there, interleaved with the other pulls, while later batches
compute. Each outcome goes back to the scheduler (``KVPullResult``) with the bytes and
seconds it took. Every NIXL call runs on that one thread, under the pull's deadline: the
event loop never waits for a transfer, and no transfer waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
import weakref
from collections import Counter as Tally
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from messages.kv_transfer import KVPull, KVPullResult, KVSourceInfo
from services.common.config import KVLayout
from services.runtime.tracing import ATTR_REQUEST_ID, ATTR_SHARD, Tracer, parse_traceparent
from services.worker.kv_cache import PagedKV
from services.worker.kv_int4.paged import Int4KV
from services.worker.kv_transfer import agent as kvt
from services.worker.kv_transfer.agent import KVTransferAgent, TransferError
from services.worker.kv_transfer.arena import KVArena
from services.worker.kv_transfer.pull_queue import PullJob, PullOutcome, PullQueue
from services.worker.kv_transfer.retired import RetiredArenas

# a source's description comes over NATS; past this the pull fails (source_lost)
META_TIMEOUT_S = 2.0
# pulls whose source was asked for and whose batch has not run yet (a batch of an epoch
# that ended never runs: its entries age out)
_MAX_PREPARED = 4096
# how long a runner's replacement waits for the transfer thread to let go of the old KV
# (its pulls' aborts included: 2 s each at most when NIXL does not confirm them)
RETIRE_TIMEOUT_S = 15.0
TRANSFER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

# fetches a worker's KVSourceInfo (None: nobody answered)
FetchSource = Callable[[str, float], Awaitable[KVSourceInfo | None]]


def arena_of(runner: Any) -> KVArena | None:
    """The KV arenas of a ``ModelRunner`` (its paged KV: codes and any scales) or a
    ``SimRunner`` (None: it has none)."""
    arena = getattr(runner, "kv_arena", None)
    if arena is not None:
        return arena
    kv = getattr(runner, "kv", None)
    if isinstance(kv, PagedKV | Int4KV):
        return KVArena.of(kv)
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
        self.queue = PullQueue(
            lambda: KVTransferAgent(f"rlt-worker-{worker_id}"),
            self._done,
            chunk_bytes=int(os.environ.get("RLT_KV_TRANSFER_CHUNK_BYTES", kvt.DEFAULT_CHUNK_BYTES)),
            # tests only: each pull waits this long after each chunk (a fault can strike
            # mid-pull, deterministically)
            hold_s=float(os.environ.get("RLT_KV_TRANSFER_TEST_HOLD_S", "0")),
        )
        self._started = False
        self.retired = RetiredArenas()  # host KV a peer may still read, kept a while
        # where results are reported (made on the service's loop, as its setup runs)
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        self._sources: dict[str, KVSourceInfo] = {}  # by worker, while it answers
        self._fetching: dict[str, asyncio.Task[KVSourceInfo | None]] = {}
        # transfer id -> its source's description, resolved on the loop
        self._prepared: OrderedDict[str, concurrent.futures.Future[KVSourceInfo]] = OrderedDict()
        # (runner, epoch) whose arenas are registered; the runner weakly: a replaced
        # runner's KV must be freed before the next one is allocated
        self._registered: tuple[weakref.ref[Any], str] | None = None
        # (epoch, result) for the service to send to that epoch's scheduler
        self.results: asyncio.Queue[tuple[str, KVPullResult]] = asyncio.Queue()
        self.num_pulls = self.num_failed = 0
        self.num_bytes = 0
        self.failures: Tally[str] = Tally()
        # (bytes, seconds, copy seconds) of the latest pulls that succeeded (health)
        self.recent: deque[tuple[int, float, float]] = deque(maxlen=1000)

    async def start(self) -> None:
        """Starts the transfer thread and its NIXL agent (it takes a while)."""
        self._loop = asyncio.get_running_loop()
        self._started = True
        await asyncio.wrap_future(self.queue.start())

    def close(self) -> None:
        """Blocking: aborts what is in flight and stops the thread."""
        self.queue.close()

    async def source_info(self) -> KVSourceInfo:
        """Our description for a peer (after every registration queued before it)."""
        return await asyncio.wrap_future(self.queue.call(lambda agent: agent.source_info()))

    def prepare(self, pulls: list[KVPull]) -> None:
        """On the event loop, as their batch arrives: each pull's source description, from
        the cache or asked of its worker (without waiting: the batch is queued meanwhile);
        a pull whose source cannot be described fails when its turn comes."""
        if not self._started:
            return  # no agent: ``before_batch`` fails them (unavailable)
        for pull in pulls:
            future: concurrent.futures.Future[KVSourceInfo] = concurrent.futures.Future()
            self._prepared[pull.transfer_id] = future
            while len(self._prepared) > _MAX_PREPARED:
                self._prepared.popitem(last=False)
            known = self._sources.get(pull.worker_id)
            if known is not None and known.epoch == pull.worker_epoch:
                future.set_result(known)
                continue
            task = self._fetching.get(pull.worker_id)
            if task is None:
                task = asyncio.ensure_future(self._fetch(pull.worker_id))
                self._fetching[pull.worker_id] = task
            task.add_done_callback(lambda t, p=pull, f=future: self._resolve(p, f, t))

    async def _fetch(self, worker_id: str) -> KVSourceInfo | None:
        try:
            return await self._fetch_source(worker_id, META_TIMEOUT_S)
        except Exception as exc:  # the bus said no: no such worker any more
            self.log.warning("KV source unreachable", worker=worker_id, error=repr(exc)[:200])
            return None
        finally:
            self._fetching.pop(worker_id, None)

    def _resolve(
        self,
        pull: KVPull,
        future: concurrent.futures.Future[KVSourceInfo],
        task: asyncio.Task[KVSourceInfo | None],
    ) -> None:
        info = None if task.cancelled() or task.exception() else task.result()
        if info is None:
            why = f"worker {pull.worker_id} did not describe its KV"
            future.set_exception(TransferError(kvt.SOURCE_LOST, why))
        elif info.error:
            future.set_exception(TransferError(info.error_cause or kvt.ERROR, info.error))
        elif info.epoch != pull.worker_epoch:
            why = f"worker {pull.worker_id} is at epoch {info.epoch}, not {pull.worker_epoch}"
            future.set_exception(TransferError(kvt.SOURCE_RESET, why))
        else:
            self._sources[pull.worker_id] = info
            future.set_result(info)

    def before_batch(self, runner: Any, epoch: str, kv_layout: str, pulls: list[KVPull]) -> None:
        """On the compute thread (or the loop) just before a batch runs: (re)registers the
        runner's arenas, then hands the batch's pulls to the transfer thread."""
        self.retired.expire(time.monotonic())
        if not self._started:
            for pull in pulls:
                why = TransferError(kvt.UNAVAILABLE, "this worker has no KV transfer agent")
                self._finish(epoch, pull, why, 0, 0.0, 0.0)
            return
        registered = self._registered
        if registered is None or registered[0]() is not runner or registered[1] != epoch:
            arena = arena_of(runner)
            if arena is not None:
                self._registered = (weakref.ref(runner), epoch)
                layout = arena.layout(kv_layout, num_planes(kv_layout, self.total_loops))
                done = self.queue.call(
                    lambda agent: agent.register(arena, epoch, layout), resets=True
                )
                done.add_done_callback(lambda f, e=epoch: self._registered_or_not(f, e))
        for pull in pulls:
            source = self._prepared.pop(pull.transfer_id, None)
            if source is None:  # never prepared (a bug): it fails by name, not silently
                source = concurrent.futures.Future()
                source.set_exception(TransferError(kvt.ERROR, "no source was asked for"))
            self.queue.submit(PullJob(epoch, pull, source))

    def _registered_or_not(self, done: concurrent.futures.Future[Any], epoch: str) -> None:
        """On the transfer thread: a registration NIXL refused is logged and counted; peers
        asking for our KV get its cause (``KVSourceInfo.error_cause``)."""
        exc = done.exception()
        if exc is None:
            return
        self.failures[kvt.REGISTRATION_FAILED] += 1
        self.log.error("KV registration with NIXL failed", epoch=epoch, error=repr(exc)[:300])

    def retire(self, timeout: float = RETIRE_TIMEOUT_S) -> None:
        """Blocking, on the compute thread just before the runner is replaced: ends the
        pulls landing in its KV and withdraws that KV from NIXL, so that nothing holds it
        once the runner goes (the new runner's KV is sized to the memory the old one
        frees; a peer reading it meanwhile fails instead of reading freed memory)."""
        if not self._started or self._registered is None:
            return
        runner = self._registered[0]()
        self._registered = None
        done = self.queue.call(lambda agent: agent.deregister(), resets=True)
        arena = arena_of(runner) if runner is not None else None
        if arena is not None:  # a peer's read may still land there (retired.py)
            self.retired.keep(arena, time.monotonic())
        try:
            done.result(timeout)
        except concurrent.futures.TimeoutError:
            self.log.error(
                "the KV transfer thread did not let go of the old KV in time; it stays "
                "allocated", timeout_s=timeout,
            )  # fmt: skip

    def _done(self, outcome: PullOutcome) -> None:
        """On the transfer thread."""
        self._finish(
            outcome.job.epoch,
            outcome.job.pull,
            outcome.error,
            outcome.num_bytes,
            outcome.seconds,
            outcome.copy_s,
            outcome.abort_unconfirmed,
        )

    def _finish(
        self,
        epoch: str,
        pull: KVPull,
        error: TransferError | None,
        moved: int,
        seconds: float,
        copy_s: float,
        abort_unconfirmed: bool = False,
    ) -> None:
        result = KVPullResult(
            transfer_id=pull.transfer_id,
            request_id=pull.request_id,
            ok=error is None,
            cause="" if error is None else error.cause,
            message="" if error is None else str(error)[:300],
            num_bytes=moved,
            seconds=seconds,
            copy_s=copy_s,
            abort_unconfirmed=abort_unconfirmed,
        )
        if self._loop is None:
            return  # made off any loop (a test): nobody to tell
        with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
            self._loop.call_soon_threadsafe(self._report, epoch, pull, result)

    def _report(self, epoch: str, pull: KVPull, result: KVPullResult) -> None:
        """On the event loop: metrics, the span, the log line, and the result queued."""
        self.num_pulls += 1
        if result.ok:
            self.num_bytes += result.num_bytes
            self.metrics.bytes.inc(result.num_bytes)
            self.metrics.seconds.observe(result.seconds)
            self.recent.append((result.num_bytes, result.seconds, result.copy_s))
        else:
            self.num_failed += 1
            self.failures[result.cause] += 1
            self.metrics.failures.labels(cause=result.cause).inc()
            if result.cause in (kvt.SOURCE_LOST, kvt.SOURCE_RESET):
                known = self._sources.get(pull.worker_id)
                if known is not None and known.epoch == pull.worker_epoch:
                    del self._sources[pull.worker_id]  # asked again next time
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
                    "rlt.kv_copy_s": result.copy_s,
                },
            )
            span.end(error=None if result.ok else f"{result.cause}: {result.message}")
        fields = {
            "request_id": pull.request_id,
            "transfer_id": pull.transfer_id,
            "bytes": result.num_bytes,
            "ms": round(result.seconds * 1e3, 3),
            "copy_ms": round(result.copy_s * 1e3, 3),
        }
        if result.ok:
            self.log.info("KV pulled", **fields)
        elif result.abort_unconfirmed:
            self.log.error(
                "KV pull failed and its abort was not confirmed: its landing blocks stay "
                "out of use", cause=result.cause, error=result.message, **fields,
            )  # fmt: skip
        else:
            self.log.warning("KV pull failed", cause=result.cause, error=result.message, **fields)
        self.results.put_nowait((epoch, result))

    def health(self) -> dict[str, Any]:
        return {
            "kv_pulls": self.num_pulls,
            "kv_pulls_failed": self.num_failed,
            "kv_pull_failures_by_cause": dict(self.failures),
            "kv_bytes_pulled": self.num_bytes,
            "kv_pulls_active": self.queue.num_active,
            "kv_pulls_landing": self.queue.num_started,
            "kv_sources_known": len(self._sources),
            "kv_arenas_retired_held": len(self.retired),
            "kv_recent_pulls": [list(p) for p in self.recent],
        }
