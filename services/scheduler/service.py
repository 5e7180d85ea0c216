"""Scheduler actor: runs ``Scheduler`` over NATS.

``SchedulerDriver`` (driver.py) is the pure part. This shell feeds admitted requests,
aborts and worker results into it, publishes batches to the worker (msgpack) and stream
events to each client's reply subject (JSON).

Reliability (see docs/services.md, "Failures"): batches go to one worker at a time, chosen
from heartbeats (``liveness.py``); a lost worker, batch or result starts a new epoch through
``worker_lost`` -> ``Scheduler.reset_after_worker_loss`` (running requests are recomputed on
the next worker, clients only see a delay); while no worker is up requests wait up to
``worker_wait_s``; stream events carry a reply subject so a vanished client is noticed and
its request aborted; deliveries are held while the bus is down and sent after a grace period.

Fencing (docs/services.md, "Fencing"): admission ends a lost scheduler's requests with
``unavailable`` only once nats-server dropped that scheduler's connection. So after any time
cut off from NATS, or any stall of our own (the loop stopped ticking), client events are held
until every admission we hold streams for answered a ``FenceQuery``: the requests it ended
meanwhile are dropped without another event, the rest go on. No client hears from two sides.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from prometheus_client import CollectorRegistry

from messages.api import StreamEvent, TokenEvent
from messages.errors import ErrorCode
from messages.internal import (
    AbortAck,
    AbortForward,
    AdmittedRequest,
    FenceQuery,
    FenceUpdate,
    RelayBatch,
    RelayedEvent,
    ShardAnnounce,
    WorkerBatch,
    WorkerHeartbeat,
    WorkerResult,
)
from messages.prefix import PrefixEventBatch, blocks_digest
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.bus import (
    Reassembler,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    fits,
    is_no_responders,
    publish_chunked,
)
from services.runtime.logging import BATCH_SEQ, request_fields
from services.runtime.service import Endpoint, Service
from services.runtime.tracing import TRACEPARENT
from services.scheduler.driver import Delivery, SchedulerDriver, StreamKey, error_event
from services.scheduler.liveness import LossDetector, WorkerTracker
from services.scheduler.prefix_publisher import PrefixPublisher
from services.scheduler.scheduler import Scheduler

# a gap this long in our own 0.1 s watchdog tick means we were stalled (or starved): what we
# publish next may come after admission gave up on us, so we check first (fencing)
_STALL_S = 1.0
# how long the fence check keeps asking an admission that does not answer
_FENCE_WAIT_S = 5.0
# load reports go out on every change, but at most one per this gap (plus the periodic ones)
_LOAD_MIN_GAP_S = 0.02


def replace_id(event: StreamEvent, request_id: str) -> StreamEvent:
    return msgspec.structs.replace(event, request_id=request_id)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass(frozen=True)
class SchedulerOptions:
    """Timeouts of the scheduler service (env names in ``from_env``; docs/services.md)."""

    # a batch not answered in this long: the worker is hung (declared lost, then suspect)
    batch_timeout_s: float = 300.0
    # no heartbeat for this long (while we were connected): the worker is dead
    heartbeat_timeout_s: float = 3.0
    # how long requests wait while no worker is up before they end with "unavailable"
    worker_wait_s: float = 60.0
    # a request older than this ends with "timeout" (abandoned or runaway streams)
    max_request_s: float = 3600.0
    # after a NATS reconnect, client events are held this long so clients can resubscribe
    reconnect_grace_s: float = 2.0
    # a batch/result a heartbeat says is missing must be this overdue before it counts lost
    loss_grace_s: float = 2.0
    load_interval_s: float = 0.25
    # the engine shard this scheduler drives (``--shard``): its subjects and its workers
    shard_id: str = subjects.DEFAULT_SHARD
    # prefix-event producer name, stable across restarts, one per shard ("" = from the
    # shard: ``scheduler-<shard>``; RLT_SCHEDULER_NAME overrides it)
    producer_name: str = ""
    # admission's RLT_SCHEDULER_LOST_S: after a dark spell shorter than this, no admission
    # can have ended our requests (used when an admission does not answer a fence query)
    scheduler_lost_s: float = 10.0
    # how long an abort that came before its request is remembered
    abort_keep_s: float = 10.0

    @classmethod
    def from_env(cls, **overrides: Any) -> SchedulerOptions:
        base = cls(**overrides)
        return cls(
            batch_timeout_s=_env_float("RLT_BATCH_TIMEOUT_S", base.batch_timeout_s),
            heartbeat_timeout_s=_env_float(
                "RLT_WORKER_HEARTBEAT_TIMEOUT_S", base.heartbeat_timeout_s
            ),
            worker_wait_s=_env_float("RLT_WORKER_WAIT_S", base.worker_wait_s),
            max_request_s=_env_float("RLT_MAX_REQUEST_S", base.max_request_s),
            reconnect_grace_s=_env_float("RLT_RECONNECT_GRACE_S", base.reconnect_grace_s),
            loss_grace_s=base.loss_grace_s,
            load_interval_s=base.load_interval_s,
            shard_id=subjects.check_shard_id(base.shard_id),
            producer_name=os.environ.get("RLT_SCHEDULER_NAME") or base.producer_name,
            scheduler_lost_s=_env_float("RLT_SCHEDULER_LOST_S", base.scheduler_lost_s),
            abort_keep_s=_env_float("RLT_ABORT_TOMBSTONE_S", base.abort_keep_s),
        )

    @property
    def producer(self) -> str:
        return self.producer_name or f"scheduler-{self.shard_id}"


@dataclass
class StepTimings:
    """Where the scheduler service's time goes per step, summed since start (seconds): the
    bench reads them from the health reply to break the bus overhead down."""

    steps: int = 0  # steps that built or applied something
    step_s: float = 0.0  # EngineCore.step: apply results, schedule, submit
    encode_s: float = 0.0  # msgpack of the batches for the worker
    publish_s: float = 0.0  # handing the batches to the NATS client
    deliver_s: float = 0.0  # client events (direct or relayed): encode + publish
    results: int = 0
    round_trip_s: float = 0.0  # batch sent -> its result received
    worker_s: float = 0.0  # of which the worker held it (received -> result sent)

    def snapshot(self) -> dict[str, float]:
        return dict(self.__dict__)


class SchedulerService(Service):
    name = "scheduler"
    description = "request state, batch selection, progress and logical KV"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        config: SchedulerConfig,
        *,
        batch_timeout_s: float | None = None,
        load_interval_s: float | None = None,
        options: SchedulerOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.checkpoint = Path(checkpoint)
        self.config = config
        opts = options or SchedulerOptions()
        if batch_timeout_s is not None:  # the older keyword arguments still work
            opts = replace(opts, batch_timeout_s=batch_timeout_s)
        if load_interval_s is not None:
            opts = replace(opts, load_interval_s=load_interval_s)
        self.options = opts
        self.shard = opts.shard_id  # the label on our metrics and spans
        self.driver: SchedulerDriver | None = None
        self.workers = WorkerTracker(opts.heartbeat_timeout_s)
        self.loss = LossDetector(opts.loss_grace_s)
        self.no_worker_since: float | None = None
        self.num_clients_gone = 0
        # client events and notices held while the bus is down or a fence check is pending
        # (sent in order afterwards): (subject, data, reply, the try they belong to)
        self._held: list[tuple[str, bytes, str, StreamKey | None]] = []
        self._results_in = Reassembler()
        self._wake = asyncio.Event()
        self._last_load = 0.0
        self.timings = StepTimings()
        self._load_later: asyncio.Future[None] | None = None
        self.prefix_publisher: PrefixPublisher | None = None
        # fencing: since when we may have been unreachable or stalled (None: not dark), the
        # latest cause, the check that ends a dark spell, and the watchdog's last tick
        self._dark_since: float | None = None
        self._dark_mark = 0.0  # the latest cause of going dark (grows with each new one)
        self._fence_task: asyncio.Task[None] | None = None
        self._last_tick = time.monotonic()
        self.num_fenced = 0

    async def setup(self) -> None:
        self.driver = SchedulerDriver(
            self.config,
            load_model_limits(self.checkpoint),
            TextCodec.from_checkpoint(self.checkpoint),
            instance=self.instance_id,
            producer_id=self.options.producer,
            shard_id=self.options.shard_id,
            log=self.log,
            abort_keep_s=self.options.abort_keep_s,
        )

    @property
    def scheduler(self) -> Scheduler:
        assert self.driver is not None
        return self.driver.scheduler

    @property
    def shard_id(self) -> str:
        return self.options.shard_id

    def endpoints(self) -> Sequence[Endpoint]:
        assert self.driver is not None
        shard = self.shard_id
        own = f"rlt-scheduler-{self.instance_id}"  # a queue group of its own: every message
        return (
            Endpoint("submit", subjects.sched_submit(shard), self._on_submit),
            Endpoint("abort", subjects.sched_abort(shard), self._on_abort),
            # aborts for requests whose shard the sender did not know: every shard hears them
            Endpoint("abort-any", subjects.SCHED_ABORT, self._on_abort, queue_group=own),
            Endpoint("load", subjects.SCHED_LOAD_GET, self._on_load_get),
            Endpoint("discover", subjects.SHARD_DISCOVER, self._on_discover, queue_group=own),
            Endpoint("shard-health", subjects.health(self.name, shard), self._on_shard_health),
            # this shard's workers' heartbeats
            Endpoint(
                "heartbeat", subjects.worker_heartbeat(shard), self._on_heartbeat, queue_group=own
            ),
            # plain subscriptions: they must receive nats-server's "no responders" status for
            # our own publishes (batches with no worker behind them, events for a vanished
            # client), which nats-server never gives a queue subscriber
            Endpoint(
                "results",
                subjects.worker_results_of(self.instance_id),
                self._on_result,
                micro=False,
            ),
            Endpoint(
                "gone", subjects.streams_gone_of(self.instance_id), self._on_gone, micro=False
            ),
            # "are you there?": nats-server answers "no responders" once our connection is
            # gone, which is what lets admission and workers give up on us (fencing)
            Endpoint("alive", subjects.sched_alive(self.instance_id), self._on_alive, micro=False),
        )

    async def on_ready(self) -> None:
        if self.config.enable_prefix_caching:
            assert self.driver is not None
            self.prefix_publisher = PrefixPublisher(
                self.nc, self.driver.producer_id, rebase=self._rebase_prefix, log=self.log
            )
            self.spawn(self.prefix_publisher.run(), "prefix-events")
        self.spawn(self._loop(), "loop")
        self.spawn(self._housekeeping(), "housekeeping")
        self._last_tick = time.monotonic()  # set-up time (loading a checkpoint) is no stall
        self.spawn(self._watchdog(), "watchdog")
        # workers: say hello now; routers: this shard is here
        await self.nc.publish(subjects.worker_discover(self.shard_id), b"")
        await self._announce()

    async def drain(self, timeout: float) -> None:
        assert self.driver is not None
        self.driver.draining = True
        deadline = time.monotonic() + timeout
        while self._draining_waits() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.driver.idle:
            await self._deliver(
                self.driver.reset(
                    ErrorCode.UNAVAILABLE, "scheduler shut down before the request finished"
                )
            )
        await self._flush_notices()
        await self._flush_relayed()
        await self._release_held()
        if self.prefix_publisher is not None:
            self.prefix_publisher.submit(self.driver.take_prefix_events())
            await self.prefix_publisher.flush(5.0)

    def _draining_waits(self) -> bool:
        assert self.driver is not None
        # a fence check that can still finish (we are on the bus) must, before the held
        # client events can go out
        fence_due = self._dark_since is not None and self.bus_connected
        return not self.driver.idle or fence_due

    async def on_bus_lost(self) -> None:
        # hold client events: published now they would reach nobody (the clients are
        # reconnecting too) and be silently dropped; and admission may end our requests
        # while we are away, so they wait for its word (fencing)
        self._go_dark(time.monotonic(), "cut off from NATS")

    async def on_bus_back(self) -> None:
        # the pause says nothing about the workers: judge them from fresh heartbeats
        await self.nc.publish(subjects.worker_discover(self.shard_id), b"")
        self._wake.set()

    def metrics_registry(self) -> CollectorRegistry | None:
        return self.driver.telemetry.registry if self.driver is not None else None

    def health_details(self) -> dict[str, Any]:
        if self.driver is None:
            return {}
        d = self.driver
        s = d.scheduler
        return {
            "shard": self.shard_id,
            "epoch": d.epoch,
            "worker": d.worker_id,
            "simulated": d.simulated,
            "resumed_requests": d.num_resumed,
            "workers_known": len(self.workers.workers),
            "worker_losses": d.num_worker_losses,
            "clients_gone": self.num_clients_gone,
            "live_requests": len(s.requests),
            "streams": len(d.streams),
            "running": len(s.running),
            "inflight_batches": len(d.inflight),
            "batches": s.stats.num_batches,
            "free_kv_blocks": s.kv.num_free_blocks,
            "num_kv_blocks": s.kv.num_blocks,
            "held_messages": len(self._held),
            "dark": self._dark_since is not None,
            "fenced_requests": self.num_fenced,
            "abort_tombstones": len(d.tombstones),
            # the scheduler's own prefix table, to compare with the prefix index's view
            "prefix_producer": d.producer_id,
            "prefix_epoch": s.prefix_log.epoch,
            "prefix_blocks": len(s.kv.cached_block_hashes()),
            "prefix_digest": blocks_digest(s.kv.cached_block_hashes()),
            "prefix_events": self.prefix_publisher.stats() if self.prefix_publisher else {},
            "timings": self.timings.snapshot(),
        }

    # ------------------------------------------------------------------ handlers
    async def _on_submit(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            req = decode_msgpack(msg.data, AdmittedRequest)
        except msgspec.DecodeError as exc:  # version skew with admission: nowhere to answer
            self.log.error("undecodable submit", error=str(exc)[:200])
            return
        # only admission's tracking subjects get notices or relayed events (never an
        # arbitrary subject a message names)
        track = msg.reply if (msg.reply or "").startswith(subjects.ADMISSION_TRACK_PREFIX) else ""
        if req.relay_subject and not req.relay_subject.startswith(subjects.ADMISSION_TRACK_PREFIX):
            self.log.error("submit with a bad relay subject dropped", request_id=req.request_id)
            return
        traceparent = (msg.headers or {}).get(TRACEPARENT, "")
        await self._deliver(self.driver.add(req, track=track, traceparent=traceparent))
        await self._flush_notices()
        await self._flush_relayed()
        self._wake.set()

    async def _on_abort(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            abort = decode_msgpack(msg.data, AbortForward)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable abort", error=str(exc)[:200])
            return
        held = abort.request_id in self.driver.streams
        if abort.broadcast and msg.reply:  # admission gathers who held it
            ack = AbortAck(request_id=abort.request_id, shard_id=self.shard_id, held=held)
            await self.nc.publish(msg.reply, encode_msgpack(ack))
        if not abort.broadcast or held:
            self.log.info("abort received", **request_fields(abort.request_id, abort.trace_id))
        await self._deliver(
            self.driver.abort(
                abort.request_id,
                abort.reply_subject,
                abort.tenant,
                admission_id=abort.admission_id,
                admission_seq=abort.admission_seq,
                broadcast=abort.broadcast,
            )
        )
        await self._flush_notices()
        await self._flush_relayed()
        self._wake.set()

    async def _publish_prefix(self, batches: list[PrefixEventBatch]) -> None:
        # queued for the JetStream publisher, which keeps event_seq order (prefix_publisher.py)
        if self.prefix_publisher is not None:
            self.prefix_publisher.submit(batches)

    def _rebase_prefix(self) -> PrefixEventBatch:
        """A new prefix epoch carrying the whole cache (the publisher lost envelopes)."""
        s = self.scheduler
        return s.prefix_log.rebase(s.kv.snapshot_prefix_events())

    async def _on_load_get(self, msg: Msg) -> None:
        assert self.driver is not None
        if msg.reply:
            await self.nc.publish(msg.reply, encode_msgpack(self._load()))

    async def _on_discover(self, _msg: Msg) -> None:
        await self._announce()

    async def _on_shard_health(self, msg: Msg) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, encode_json(self.health()))

    async def _announce(self) -> None:
        cfg = self.config
        announce = ShardAnnounce(
            shard_id=self.shard_id,
            scheduler_id=self.instance_id,
            producer_id=self.options.producer,
            block_size=cfg.block_size,
            num_blocks=cfg.num_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching,
            time=time.time(),
        )
        try:
            await self.nc.publish(subjects.SHARD_ANNOUNCE, encode_msgpack(announce))
        except Exception as exc:  # the next discover asks again
            self.log.warning("shard announcement not sent", error=repr(exc)[:200])

    def _load(self):  # type: ignore[no-untyped-def]
        d = self.driver
        assert d is not None
        d.has_worker = d.worker_id is not None and self.no_worker_since is None
        return d.load()

    async def _on_heartbeat(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            hb = decode_msgpack(msg.data, WorkerHeartbeat)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable heartbeat", error=str(exc)[:200])
            return
        now = time.monotonic()
        self.workers.heartbeat(hb, now)
        d = self.driver
        if hb.worker_id == d.worker_id:
            inflight = [b.seq for b in d.inflight]
            reason = self.loss.check(hb, d.epoch, inflight, d.executor.sent_at, now)
            if reason is not None:
                d.worker_lost(reason)
        self._wake.set()

    async def _on_result(self, msg: Msg) -> None:
        assert self.driver is not None
        epoch = msg.subject[len(subjects.WORKER_RESULT) + 1 :]
        if epoch != self.driver.epoch:
            return  # a result or status from before a reset
        if is_no_responders(msg):
            # nobody subscribes to the bound worker's batch subject: its process is gone
            if self.driver.worker_id is not None:
                self.workers.forget(self.driver.worker_id)
            self.driver.worker_lost(f"no worker is serving {subjects.WORKER_BATCH}")
            self._bind_worker()  # another worker of this shard, or "no worker" in the report
            await self._maybe_publish_load(force=True)  # routers learn it now
            self._wake.set()
            return
        data = self._results_in.feed(msg)
        if data is None:
            return  # a part of a bigger result
        try:
            wr = decode_msgpack(data, WorkerResult)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable worker result", error=str(exc)[:200])
            return
        if wr.refused:
            self._on_refused(wr)
            return
        # seq + epoch + worker instance: a result is applied once, from the bound worker
        if self.driver.on_result(wr):
            took = self.driver.last_round_trip_s
            if took is not None:
                self.timings.results += 1
                self.timings.round_trip_s += took
                self.timings.worker_s += wr.worker_s
            self._wake.set()

    def _on_refused(self, wr: WorkerResult) -> None:
        """The worker serves another scheduler that is still connected: try another (or
        this one again once it is free)."""
        d = self.driver
        assert d is not None
        if wr.epoch != d.epoch or wr.worker_id != d.worker_id:
            return
        self.workers.mark_taken(wr.worker_id, time.monotonic() + 2.0)
        d.worker_lost(f"worker {wr.worker_id} refused our batches: {wr.refused}")
        self._wake.set()

    async def _on_alive(self, msg: Msg) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, b"")

    async def _on_gone(self, msg: Msg) -> None:
        assert self.driver is not None
        if not is_no_responders(msg):
            return
        try:
            stream_no = int(msg.subject.rsplit(".", 1)[1])
        except ValueError:
            return
        if self.driver.client_gone(stream_no):
            self.num_clients_gone += 1
            await self._flush_notices()
            self._wake.set()

    # ------------------------------------------------------------------ loop
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                progressed = await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step end the loop (and the service)
                self.log.exception("scheduler step failed")
                await asyncio.sleep(0.05)
                continue
            if not progressed:
                await self._wake.wait()

    async def _step(self) -> bool:
        driver = self.driver
        assert driver is not None
        before = len(driver.inflight), driver.scheduler.stats.num_batches
        t0 = time.perf_counter()
        out = driver.step(schedule=self.bus_connected and self._bind_worker())
        t1 = time.perf_counter()
        batches = driver.executor.take_outbox()
        # batches first: the worker is the critical path, clients can wait a moment
        for wb in batches:
            await self._publish_batch(wb)
        t2 = time.perf_counter()
        await self._deliver(out)
        relayed = await self._flush_relayed()
        t3 = time.perf_counter()
        await self._flush_notices()
        await self._publish_prefix(driver.take_prefix_events())
        after = len(driver.inflight), driver.scheduler.stats.num_batches
        if out or relayed or batches or before != after:
            timings = self.timings
            timings.steps += 1
            timings.step_s += t1 - t0
            timings.deliver_s += t3 - t2
            await self._maybe_publish_load()
            return True
        return False

    def _bind_worker(self) -> bool:
        """Judges the bound worker and binds one if needed; False when none is usable."""
        d = self.driver
        assert d is not None
        now = time.monotonic()
        since = self.bus_connected_since
        bound = d.worker_id
        if bound is not None:
            info = self.workers.workers.get(bound)
            if self.workers.is_dead(bound, now, since):
                self.workers.forget(bound)
                timeout = self.workers.heartbeat_timeout_s
                d.worker_lost(f"worker {bound} sent no heartbeat for {timeout}s")
            elif info is not None and info.heartbeat.draining:
                if d.inflight:
                    return False  # let it finish what it has, then move on
                d.worker_lost(f"worker {bound} is draining")
        chosen = self.workers.choose(d.worker_id, now, since)
        if chosen is None:
            if self.no_worker_since is None:
                self.no_worker_since = now
                # before any worker has been seen (a normal start) this is not a problem
                log = self.log.warning if d.streams or self.workers.workers else self.log.info
                log("no worker available; requests wait", streams=len(d.streams))
            return False
        self.no_worker_since = None
        d.bind(chosen)
        return True

    async def _publish_batch(self, wb: WorkerBatch) -> None:
        d = self.driver
        assert d is not None
        if wb.epoch != d.epoch:
            return  # its worker was lost while earlier batches went out: it is replanned
        batch = wb.batch
        self.log.debug(
            "batch sent", phase=str(batch.phase), rows=len(batch.rows), **{BATCH_SEQ: batch.seq}
        )
        try:
            t0 = time.perf_counter()
            data = encode_msgpack(wb)
            t1 = time.perf_counter()
            # a batch bigger than max_payload (many new prompts) travels in parts
            await publish_chunked(
                self.nc,
                subjects.worker_batch(wb.worker_id),
                data,
                reply=subjects.worker_result(wb.epoch),
            )
            self.timings.encode_s += t1 - t0
            self.timings.publish_s += time.perf_counter() - t1
        except Exception as exc:  # e.g. the bus dropped and the outbound buffer is full
            if wb.epoch == d.epoch:
                d.worker_lost(f"batch {batch.seq} could not be sent: {exc!r}")

    async def _deliver(self, deliveries: list[Delivery]) -> None:
        assert self.driver is not None
        for subject, event in deliveries:
            rid = event.request_id
            # a named tenant's ids are scoped inside ("acme/req-1"): the client sees its own
            public = subjects.public_request_id(rid)
            data = encode_json(event if public == rid else replace_id(event, public))
            if not fits(self.nc, len(data)):
                data = self._too_large(subject, event, len(data))
            # token events carry a reply subject: nats-server answers it with "no responders"
            # when the client is gone, and the request is aborted (see _on_gone)
            reply = ""
            if isinstance(event, TokenEvent):
                reply = self.driver.gone_subject(rid)
            await self._send(subject, data, reply, self.driver.stream_key(rid))

    def _too_large(self, subject: str, event: StreamEvent, size: int) -> bytes:
        """An event over NATS max_payload (a very long finished event): the client gets a
        clear error instead, and a live request is ended."""
        message = self._fail_too_large(event, size)
        public = subjects.public_request_id(event.request_id)
        return encode_json(error_event(public, ErrorCode.INTERNAL, message))

    def _fail_too_large(self, event: StreamEvent, size: int) -> str:
        assert self.driver is not None
        lower = "prompt_logprobs" if isinstance(event, TokenEvent) else "max_tokens"
        message = (
            f"the {type(event).__name__} of {size} bytes exceeds the NATS max_payload of "
            f"{self.nc.max_payload} bytes; lower {lower} or raise max_payload"
        )
        self.log.error("event too large", size=size, request_id=event.request_id)
        self.driver.fail_request(event.request_id, ErrorCode.INTERNAL, message)
        return message

    async def _flush_relayed(self) -> bool:
        """One message per admission with this step's events of the streams it relays;
        False if there were none or they must wait."""
        assert self.driver is not None
        if not self.driver.relayed or self._holding():
            return False  # they wait in the driver, per try, so a fence check can drop its own
        for subject, items in self.driver.take_relayed().items():
            for data in self._relay_messages(items):
                await self._send(subject, data)
        return True

    def _relay_messages(self, items: list[RelayedEvent]) -> list[bytes]:
        """``items`` as RelayBatch messages under the bus's max_payload: split when many,
        and an event too big on its own ends its request with a clear error instead."""

        def encode(part: list[RelayedEvent]) -> bytes:
            return encode_msgpack(
                RelayBatch(shard_id=self.shard_id, scheduler_id=self.instance_id, events=part)
            )

        items = [self._fits_client(item) for item in items]
        data = encode(items)
        if fits(self.nc, len(data)):
            return [data]
        if len(items) > 1:
            half = len(items) // 2
            return self._relay_messages(items[:half]) + self._relay_messages(items[half:])
        (item,) = items
        event = item.event
        if event is None:
            return []  # a resync too big to send: the stream goes on without it
        data = encode([RelayedEvent(seq=item.seq, event=self._too_large_event(event, len(data)))])
        return [data]

    def _fits_client(self, item: RelayedEvent) -> RelayedEvent:
        """Admission sends each event on as JSON, larger than here: a first token event with
        the prompt's log-probabilities (the one event that size can surprise) is measured
        as the client will get it."""
        event = item.event
        if not isinstance(event, TokenEvent) or event.prompt_logprobs is None:
            return item
        size = len(encode_json(event))
        if fits(self.nc, size):
            return item
        return RelayedEvent(seq=item.seq, event=self._too_large_event(event, size))

    def _too_large_event(self, event: StreamEvent, size: int) -> StreamEvent:
        message = self._fail_too_large(event, size)
        return error_event(event.request_id, ErrorCode.INTERNAL, message)

    async def _flush_notices(self) -> None:
        assert self.driver is not None
        for subject, notice in self.driver.take_notices():
            data = encode_msgpack(notice)
            if notice.finished is not None and not fits(self.nc, len(data)):
                # the copy of a huge finished event for admission's retry record: left out
                data = encode_msgpack(replace(notice, finished=None))
            # the try it is about (its tracking subject names it), not the stream's current
            # one: a hand-over "done" to a retry's first admission is about the old try
            key = subjects.track_try(subject) or self.driver.stream_key(notice.request_id)
            await self._send(subject, data, key=key)

    async def _send(
        self, subject: str, data: bytes, reply: str = "", key: StreamKey | None = None
    ) -> None:
        if self._holding():
            self._held.append((subject, data, reply, key))
            return
        try:
            await self.nc.publish(subject, data, reply=reply)
        except Exception as exc:  # e.g. a bad client reply subject: only that stream suffers
            self.log.warning("delivery failed", error=repr(exc)[:200], subject=subject[:100])

    # ------------------------------------------------------------------ fencing
    def _holding(self) -> bool:
        """Whether client events must wait (cut off from the bus, or a fence check due)."""
        now = time.monotonic()
        if now - self._last_tick > _STALL_S:
            # our loop did not tick for a while: we may have been stalled past the point
            # where admission gave up on us, so nothing goes out until it says
            self._go_dark(self._last_tick, f"stalled {now - self._last_tick:.1f}s")
        return self._dark_since is not None or not self.nc.is_connected

    async def _watchdog(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.1)
            now = self._last_tick = time.monotonic()
            if now - before > _STALL_S:
                self._go_dark(before, f"stalled {now - before:.1f}s")

    def _go_dark(self, since: float, why: str) -> None:
        """We may have been unreachable since ``since``: hold client events until a fence
        check says which of our requests admission ended meanwhile."""
        # a new cause moves the mark (one stall is seen by many sends)
        self._dark_mark = max(self._dark_mark, since)
        if self._dark_since is None:
            self._dark_since = since
            self.log.warning("holding client events until admission confirms them", reason=why)
        if self._fence_task is None or self._fence_task.done():
            self._fence_task = self.spawn(self._fence_check(), "fence-check")

    async def _fence_check(self) -> None:
        while True:
            mark = self._dark_mark
            await self._wait_back()
            dark_since = self._dark_since if self._dark_since is not None else time.monotonic()
            dark_s = time.monotonic() - dark_since
            held_then = self._fenceable()  # what the dark spell may have cost
            fenced, unanswered, lost_s = await self._ask_admissions()
            if mark != self._dark_mark:
                continue  # dark again meanwhile: ask again
            await self._end_dark(fenced, unanswered, dark_s, lost_s, held_then)
            if self._dark_since is not None or mark != self._dark_mark:
                await asyncio.sleep(0.05)  # (never a busy loop when nothing else awaits)
                continue  # dark again while we released the held events: this task asks
            return

    async def _wait_back(self) -> None:
        """Until we are on the bus and, after a reconnect, the clients had the grace period
        to reconnect too."""
        grace = self.options.reconnect_grace_s
        while True:
            now = time.monotonic()
            reconnected = (
                self._dark_since is not None and self.bus_connected_since > self._dark_since
            )
            if self.bus_connected and (not reconnected or now - self.bus_connected_since >= grace):
                return
            await asyncio.sleep(0.05)

    async def _ask_admissions(self) -> tuple[set[StreamKey], set[str], float]:
        """Asks every admission we hold tries for (live streams, held client events,
        relayed events not yet sent) which of them it ended. Returns the fenced tries, the
        admissions that never answered, and admission's lost time."""
        pending = {aid for aid, _ in self._fenceable()}
        fenced: set[StreamKey] = set()
        lost_s = self.options.scheduler_lost_s
        deadline = time.monotonic() + _FENCE_WAIT_S
        while pending and time.monotonic() < deadline:
            # built at each round: admission may fence more of them while we ask
            held: dict[str, list[int]] = {}
            for aid, seq in self._fenceable():
                held.setdefault(aid, []).append(seq)
            for admission_id in list(pending):
                seqs = sorted(held.get(admission_id, ()))
                if not seqs:  # nothing of its left here (ended, or taken over by a retry)
                    pending.discard(admission_id)
                    continue
                query = FenceQuery(scheduler_id=self.instance_id, seqs=seqs)
                try:
                    msg = await self.nc.request(
                        subjects.admission_fence(admission_id), encode_msgpack(query), timeout=1.0
                    )
                    update = decode_msgpack(msg.data, FenceUpdate)
                except NoRespondersError:
                    continue  # not on the bus (now): ask again shortly
                except (TimeoutError, NatsError, msgspec.DecodeError) as exc:
                    self.log.warning("fence query failed", admission=admission_id, error=repr(exc))
                    continue
                pending.discard(admission_id)
                fenced.update((admission_id, seq) for _, seq in update.fenced)
                lost_s = min(lost_s, update.scheduler_lost_s)
            if pending:
                await asyncio.sleep(0.25)
        return fenced, pending, lost_s

    def _fenceable(self) -> set[StreamKey]:
        """The tries a fence can drop here: live streams, held client events, relayed
        events not yet sent."""
        assert self.driver is not None
        return self.driver.tries() | {m[3] for m in self._held if m[3] is not None}

    async def _end_dark(
        self,
        fenced: set[StreamKey],
        unanswered: set[str],
        dark_s: float,
        lost_s: float,
        held_then: set[StreamKey],
    ) -> None:
        d = self.driver
        assert d is not None
        drop = set(fenced)
        if unanswered and dark_s >= lost_s:
            # an admission that is gone may have ended these before it went: nobody can
            # say, so they end here without a word (a double fault; docs/services.md)
            # (only the tries held when the check began: later ones were never fenced)
            drop |= {key for key in held_then if key[0] in unanswered}
            self.log.error(
                "admissions unreachable after a long dark spell; their requests dropped",
                admissions=sorted(unanswered),
                dark_s=round(dark_s, 1),
            )
        dropped = d.drop_fenced(drop)
        # also what is held for fenced requests that ended here meanwhile (their finished
        # event waits with the rest): admission already gave those clients their terminal
        ended = {m[3] for m in self._held if m[3] in drop} | d.drop_relayed(drop)
        self._held = [m for m in self._held if m[3] not in drop]
        self.num_fenced += len(set(dropped) | ended)
        self._dark_since = None
        self.log.info("fence check done", fenced=len(drop), live=len(dropped), held=len(self._held))
        await self._release_held()
        await self._flush_relayed()
        self._wake.set()

    async def _release_held(self) -> None:
        held, self._held = self._held, []
        if held:
            self.log.info("sending messages held during the outage", count=len(held))
        for subject, data, reply, key in held:
            await self._send(subject, data, reply, key)

    async def _maybe_publish_load(self, force: bool = False) -> None:
        now = time.monotonic()
        wait = _LOAD_MIN_GAP_S - (now - self._last_load)
        if not force and wait > 0:
            # at most one report per gap, but the last change always goes out: a router
            # must not see a request that just finished as load for long
            if self._load_later is None:
                self._load_later = asyncio.ensure_future(self._publish_load_after(wait))
            return
        assert self.driver is not None
        self._last_load = now
        await self.nc.publish(subjects.SCHED_LOAD, encode_msgpack(self._load()))

    async def _publish_load_after(self, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            if self.bus_connected and self.state == "ready":
                await self._maybe_publish_load(force=True)
        except Exception as exc:  # the periodic report follows anyway
            self.log.debug("load report not sent", error=repr(exc)[:200])
        finally:
            self._load_later = None

    async def _housekeeping(self) -> None:
        """Periodic load reports; the worker watchdogs; request deadlines."""
        assert self.driver is not None
        while True:
            await asyncio.sleep(self.options.load_interval_s)
            try:
                await self._housekeep()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("housekeeping failed")

    async def _housekeep(self) -> None:
        d = self.driver
        assert d is not None
        if not self.bus_connected:
            return  # nothing can be judged (or sent) while we are cut off
        await self._maybe_publish_load(force=True)
        now = time.monotonic()
        age = d.oldest_inflight_age(now)
        if age > self.options.batch_timeout_s and d.worker_id is not None:
            self.workers.mark_suspect(d.worker_id)
            d.worker_lost(f"worker did not answer batch {d.inflight[0].seq} in {age:.0f}s")
        if d.worker_id is None or d.inflight:
            self._bind_worker()  # notices a dead worker even when nothing else happens
        expired = d.expire(
            now,
            max_request_s=self.options.max_request_s,
            no_worker_since=self.no_worker_since,
            worker_wait_s=self.options.worker_wait_s,
        )
        await self._deliver(expired)
        await self._flush_notices()
        await self._flush_relayed()
        self._wake.set()
