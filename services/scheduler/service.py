"""Scheduler actor: runs ``Scheduler`` over NATS.

``SchedulerDriver`` (driver.py) is the pure part. This shell feeds admitted requests,
aborts, heartbeats and worker results into it, and every handler ends with one publish of
the ``StepOutput`` it returned (``output_publisher.py``): batches to the worker, stream
events to admission's relay subject (admission passes them on to the client), notices to
admission's tracking subjects, answers to abort requesters, prefix events to JetStream.

Reliability (see docs/services.md, "Failures"): batches go to one worker at a time, chosen
from heartbeats (``worker_binding.py``, ``liveness.py``); a lost worker, batch or result
starts a new epoch through ``worker_lost`` -> ``Scheduler.reset_after_worker_loss`` (running
requests are recomputed on the next worker, clients only see a delay); while no worker is
up requests wait up to ``worker_wait_s``; what we send about our streams is held while the
bus is down or we stalled, until admission confirms which of them it ended meanwhile
(``fencing.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from messages.errors import ErrorCode
from messages.internal import (
    AbortAck,
    AbortForward,
    AdmittedRequest,
    SchedulerLoad,
    ShardAnnounce,
    WorkerHeartbeat,
    WorkerResult,
)
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.bus import (
    Reassembler,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    is_no_responders,
)
from services.runtime.logging import request_fields
from services.runtime.service import Endpoint, Service
from services.runtime.tracing import TRACEPARENT
from services.scheduler.driver.driver import SchedulerDriver
from services.scheduler.driver.step_output import StepOutput, StreamKey
from services.scheduler.driver.worker_binding import WorkerBinding
from services.scheduler.fencing import Fence
from services.scheduler.kv_handover import KVHandover
from services.scheduler.options import SchedulerOptions
from services.scheduler.output_publisher import OutputPublisher, StepTimings
from services.scheduler.prefix_publisher import PrefixPublisher

# load reports go out on every change, but at most one per this gap (plus the periodic ones)
_LOAD_MIN_GAP_S = 0.02


class SchedulerService(Service, KVHandover):
    name = "scheduler"
    description = "request state, batch selection, progress and logical KV"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        config: SchedulerConfig,
        *,
        options: SchedulerOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.checkpoint = Path(checkpoint)
        self.config = config
        self.options = opts = options or SchedulerOptions()
        self.shard = opts.shard_id  # the label on our metrics and spans
        self.driver: SchedulerDriver | None = None
        self.binding: WorkerBinding | None = None
        self.fence = Fence(
            self,
            reconnect_grace_s=opts.reconnect_grace_s,
            scheduler_lost_s=opts.scheduler_lost_s,
        )
        self._results_in = Reassembler()
        self._wake = asyncio.Event()
        self._last_load = 0.0
        self.timings = StepTimings()
        self._load_later: asyncio.Future[None] | None = None
        self.prefix_publisher: PrefixPublisher | None = None
        self.output: OutputPublisher | None = None

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
            kv_handoff_hold_s=self.options.kv_handoff_hold_s,
            kv_transfer_timeout_s=self.options.kv_transfer_timeout_s,
        )
        self.binding = WorkerBinding(
            self.driver,
            heartbeat_timeout_s=self.options.heartbeat_timeout_s,
            loss_grace_s=self.options.loss_grace_s,
            log=self.log,
        )
        if self.config.enable_prefix_caching:
            # before any handler runs: every output's prefix events have somewhere to go
            self.prefix_publisher = PrefixPublisher(
                self.nc, self.driver.producer_id, rebase=self.driver.rebase_prefix, log=self.log
            )
        self.output = OutputPublisher(
            self.nc,
            self.driver,
            self.fence,
            prefix_publisher=self.prefix_publisher,
            timings=self.timings,
            log=self.log,
            shard_id=self.shard_id,
            scheduler_id=self.instance_id,
        )

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
            # a plain subscription: it must receive nats-server's "no responders" status for
            # batches with no worker behind them, which nats-server never gives a queue
            # subscriber
            Endpoint(
                "results",
                subjects.worker_results_of(self.instance_id),
                self._on_result,
                micro=False,
            ),
            # "are you there?": nats-server answers "no responders" once our connection is
            # gone, which is what lets admission and workers give up on us (fencing)
            Endpoint("alive", subjects.sched_alive(self.instance_id), self._on_alive, micro=False),
            # disaggregation: our worker's KV pulls, and decode shards done with our handoffs
            Endpoint(
                "kv-results",
                subjects.worker_kv_results_of(self.instance_id),
                self._on_kv_results,
                micro=False,
            ),
            Endpoint(
                "kv-release",
                subjects.sched_kv_release(self.instance_id),
                self._on_kv_release,
                micro=False,
            ),
        )

    async def on_ready(self) -> None:
        if self.prefix_publisher is not None:
            self.spawn(self.prefix_publisher.run(), "prefix-events")
        self.spawn(self._loop(), "loop")
        self.spawn(self._housekeeping(), "housekeeping")
        self.fence.start()
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
            message = "scheduler shut down before the request finished"
            await self._publish(self.driver.reset(ErrorCode.UNAVAILABLE, message))
        await self._publish(self.driver.take())  # e.g. the prefix events of a worker loss
        await self.release_held()
        if self.prefix_publisher is not None:
            await self.prefix_publisher.flush(5.0)

    def _draining_waits(self) -> bool:
        assert self.driver is not None
        # a fence check that can still finish (we are on the bus) must, before the held
        # client events can go out
        fence_due = self.fence.dark and self.bus_connected
        return not self.driver.idle or fence_due

    async def on_bus_lost(self) -> None:
        # hold client events: published now they would reach nobody (the clients are
        # reconnecting too) and be silently dropped; and admission may end our requests
        # while we are away, so they wait for its word (fencing)
        self.fence.go_dark(time.monotonic(), "cut off from NATS")

    async def on_bus_back(self) -> None:
        # the pause says nothing about the workers: judge them from fresh heartbeats
        await self.nc.publish(subjects.worker_discover(self.shard_id), b"")
        self._wake.set()

    def metrics_registry(self) -> CollectorRegistry | None:
        return self.driver.telemetry.registry if self.driver is not None else None

    def health_details(self) -> dict[str, Any]:
        if self.driver is None:
            return {}
        return {
            "shard": self.shard_id,
            **self.driver.health(),
            "workers_known": len(self.binding.workers.workers) if self.binding else 0,
            "held_messages": len(self.fence.held),
            "dark": self.fence.dark,
            "fenced_requests": self.fence.num_fenced,
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
        # only admission's tracking subjects get notices (never an arbitrary subject a
        # message names; the driver checks the relay subject the same way)
        track = msg.reply if (msg.reply or "").startswith(subjects.ADMISSION_TRACK_PREFIX) else ""
        traceparent = (msg.headers or {}).get(TRACEPARENT, "")
        await self._publish(self.driver.add(req, track=track, traceparent=traceparent))
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
        out = self.driver.abort(
            abort.request_id,
            abort.reply_subject,
            abort.tenant,
            admission_id=abort.admission_id,
            admission_seq=abort.admission_seq,
            broadcast=abort.broadcast,
        )
        await self._publish(out)
        self._wake.set()

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
            role=self.options.role,
            block_format=self.driver.scheduler.block_format if self.driver else None,
            sparse_prefill=self.driver.scheduler.sparse_prefill_offer() if self.driver else None,
            sparse_prefill_default=cfg.token_sparse_prefill,
        )
        try:
            await self.nc.publish(subjects.SHARD_ANNOUNCE, encode_msgpack(announce))
        except Exception as exc:  # the next discover asks again
            self.log.warning("shard announcement not sent", error=repr(exc)[:200])

    def _load(self) -> SchedulerLoad:
        assert self.driver is not None and self.binding is not None
        self.driver.has_worker = self.binding.has_worker
        return self.driver.load()

    async def _on_heartbeat(self, msg: Msg) -> None:
        assert self.binding is not None
        try:
            hb = decode_msgpack(msg.data, WorkerHeartbeat)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable heartbeat", error=str(exc)[:200])
            return
        self.binding.heartbeat(hb, time.monotonic())
        self._wake.set()

    async def _on_result(self, msg: Msg) -> None:
        assert self.driver is not None and self.binding is not None
        epoch = msg.subject[len(subjects.WORKER_RESULT) + 1 :]
        if epoch != self.driver.epoch:
            return  # a result or status from before a reset
        if is_no_responders(msg):
            # nobody subscribes to the bound worker's batch subject: its process is gone
            self.binding.gone(time.monotonic(), self.bus_connected_since)
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
            self.binding.refused(wr, time.monotonic())
            self._wake.set()
            return
        # seq + epoch + worker instance: a result is applied once, from the bound worker
        if self.driver.on_result(wr):
            took = self.driver.last_round_trip_s
            if took is not None:
                self.timings.results += 1
                self.timings.round_trip_s += took
                self.timings.worker_s += wr.worker_s
            self._wake.set()

    async def _on_alive(self, msg: Msg) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, b"")

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
        before = len(driver.inflight)
        t0 = time.perf_counter()
        out = driver.step(schedule=self.bus_connected and self._bind_worker())
        t1 = time.perf_counter()
        deliver_s = await self._publish(out)
        if out or len(driver.inflight) != before:  # built, applied or sent something
            timings = self.timings
            timings.steps += 1
            timings.step_s += t1 - t0
            timings.deliver_s += deliver_s
            await self._maybe_publish_load()
            return True
        return False

    def _bind_worker(self) -> bool:
        assert self.binding is not None
        return self.binding.bind(time.monotonic(), self.bus_connected_since)

    # ------------------------------------------------------------------ the fence's host
    def live_tries(self) -> set[StreamKey]:
        assert self.driver is not None
        return self.driver.tries()

    def drop_fenced(self, keys: set[StreamKey]) -> list[StreamKey]:
        assert self.driver is not None
        return self.driver.drop_fenced(keys)

    async def release_held(self) -> None:
        assert self.output is not None
        await self.output.release_held()
        self._wake.set()

    async def _publish(self, out: StepOutput) -> float:
        """Every handler ends here, with what its driver call returned."""
        assert self.output is not None
        return await self.output.publish(out)

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
        assert self.binding is not None
        now = time.monotonic()
        self.binding.check_hung(now, self.options.batch_timeout_s)
        if d.worker_id is None or d.inflight:
            self._bind_worker()  # notices a dead worker even when nothing else happens
        expired = d.expire(
            now,
            max_request_s=self.options.max_request_s,
            no_worker_since=self.binding.no_worker_since,
            worker_wait_s=self.options.worker_wait_s,
        )
        await self._publish(expired)
        await self._publish(d.expire_transfers(now))
        self._wake.set()
