"""Worker actor: owns the model and a ``ModelRunner``; executes batches strictly in seq order.

Batches arrive on ``rlt.v1.worker.batch.<this instance>`` (msgpack ``WorkerBatch``; a scheduler
binds to one worker at a time, see ``services/scheduler/driver/liveness.py``); a batch that arrives
early waits in a buffer until its predecessors are queued (``batch_queue.py``). Batches run
in seq order on one compute thread (``compute.py``) fed by a queue, so the event loop stays
free: it receives and decodes the next batches while one computes, publishes results and
heartbeats, and answers health pings. On the CPU a batch expected to take under
``inline_max_s`` runs on the event loop instead: a small model's pass holds the interpreter
lock, so a thread only interleaves the two (``compute.py`` says why, and what it measured).
A batch that raises is answered with ``BatchResult(error=...)``, never a crash. The result
goes to the batch's reply subject (the scheduler epoch's result subject).

Heartbeats (``rlt.v1.worker.heartbeat.<shard>``, every ``heartbeat_interval_s`` and on a
scheduler's ``rlt.v1.worker.discover.<shard>``) say the worker is alive and how far it got,
which lets its shard's scheduler notice a lost batch or result. A new epoch resets the device
state and starts at the epoch's first seq, so a lost first batch is waited for, never skipped.

``device="sim"`` runs no model: ``services/worker/sim.py`` accounts for each batch with a
cost model of Ouro-1.4B on an H200 (benchmarks of the control plane only; results are marked
simulated).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from prometheus_client import CollectorRegistry

from messages.batch import Batch, BatchResult
from messages.internal import WorkerBatch, WorkerHeartbeat, WorkerResult
from messages.kv_transfer import (
    KVLayoutInfo,
    KVPullResult,
    KVPullResults,
    KVPullResultsAck,
    KVSourceInfo,
)
from services.common.config import SchedulerConfig
from services.runtime import subjects
from services.runtime.bus import Reassembler, decode_msgpack, encode_msgpack, publish_chunked
from services.runtime.logging import BATCH_SEQ, request_fields
from services.runtime.service import Endpoint, Service
from services.worker.batch_queue import BatchQueue, BatchRun
from services.worker.kv_transfer.agent import TransferError
from services.worker.kv_transfer.pulls import KVPulls
from services.worker.kv_transfer.result_outbox import ResultOutbox
from services.worker.runner import ModelRunner
from services.worker.runner_host import RunnerHost
from services.worker.sim import SimRunner
from services.worker.telemetry import WorkerTelemetry


class WorkerService(Service):
    name = "worker"
    description = "model weights, device KV and batch execution"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        config: SchedulerConfig | None = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        heartbeat_interval_s: float = 0.5,
        shard_id: str = subjects.DEFAULT_SHARD,
        inline_max_s: float | None = None,
        kv_transfer: bool = False,
        **kwargs: Any,
    ) -> None:
        """``kv_transfer``: a NIXL agent for prefill/decode disaggregation (the prefill
        worker serves its KV, the decode worker pulls it)."""
        super().__init__(nats_url, **kwargs)
        self.shard_id = subjects.check_shard_id(shard_id)
        self.shard = self.shard_id  # the label on our metrics and spans
        self.heartbeat_interval_s = heartbeat_interval_s
        self._batches_in = Reassembler()
        self.config = config or SchedulerConfig()
        self.runner_host = RunnerHost(
            checkpoint,
            device,
            dtype,
            sim_kv=kv_transfer,
            before_replace=self._retire_kv,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_int4_anchor_every=self.config.kv_int4_anchor_every,
            batch_limits=self.config.batch_limits,
        )
        self.kv_transfer = kv_transfer
        self.simulated = self.runner_host.simulated
        # batches expected to run under this run on the event loop (0: never); by default
        # only on the CPU, where a pass holds the interpreter lock (compute.py)
        if inline_max_s is None:
            inline_max_s = INLINE_MAX_S if device == "cpu" else 0.0
        self.queue = BatchQueue(
            self.runner_host, inline_max_s, self.log, before_execute=self._before_execute
        )
        self.kv: KVPulls | None = None  # made at setup (it needs the model's depth)
        self._next_done = 0  # every seq before this one ran and its result is published
        # the scheduler instance whose epochs we run: another one may take us over only
        # once nats-server says that one's connection is gone (a stalled scheduler that
        # resumes must not find its worker reset by someone else, nor reset it itself)
        self._scheduler: str | None = None
        self._scheduler_seen = 0.0  # when its last batch came
        self._publishing = False  # a result is being sent (in parts, it may take a while)
        self.num_batches = 0
        self.num_failed = 0
        self.decode_s = 0.0  # decoding the batches received (msgpack), summed
        self.telemetry = WorkerTelemetry(self.shard)
        if self.config.kv_int4:
            self.telemetry.watch_int4_tails(self.runner_host.int4_tails)
        self._kv_results_task: asyncio.Task[None] | None = None
        self.kv_outbox = ResultOutbox()  # pull results until their scheduler has them
        # tests only: this many publications of pull results are lost on the way
        self._drop_kv_results = int(os.environ.get("RLT_KV_RESULTS_TEST_DROP", "0"))

    @property
    def runner(self) -> ModelRunner | SimRunner | None:
        return self.runner_host.runner

    async def setup(self) -> None:
        host = self.runner_host
        await asyncio.to_thread(host.load)
        self.kv = KVPulls(
            self.instance_id,
            host.total_loops,
            self._fetch_kv_source,
            self.telemetry.registry,
            self.log,
            shard=self.shard_id,
        )
        if self.kv_transfer:
            try:
                await self.kv.start()
            except TransferError as exc:  # refused at start, by name: not at the first pull
                raise ValueError(f"KV transfer (--role prefill|decode) needs NIXL: {exc}") from exc
        cfg = self.config
        geometry = (cfg.num_blocks, cfg.block_size, str(cfg.kv_layout))
        await asyncio.to_thread(host.make_runner, *geometry)
        self.queue.start(geometry, name=f"rlt-compute-{self.instance_id}")
        if isinstance(self.runner, SimRunner):
            self.log.warning(
                "SIMULATED device: no model runs; every output is simulated (benchmarks only)",
                dilation=self.runner.cost.dilation,
            )
        else:
            self.log.info("model loaded", checkpoint=str(host.checkpoint), device=host.device)

    def endpoints(self) -> Sequence[Endpoint]:
        return (
            Endpoint("batch", subjects.worker_batch(self.instance_id), self._on_batch),
            # every worker of the shard answers a discover: a queue group of its own
            Endpoint(
                "discover",
                subjects.worker_discover(self.shard_id),
                self._on_discover,
                queue_group=f"rlt-worker-{self.instance_id}",
            ),
            Endpoint("shard-health", subjects.health(self.name, self.shard_id), self._on_health),
            # disaggregation: decode workers ask where our KV is
            Endpoint("kv-meta", subjects.worker_kv_meta(self.instance_id), self._on_kv_meta),
            # our scheduler has these pull results: stop publishing them
            Endpoint(
                "kv-ack", subjects.worker_kv_ack(self.instance_id), self._on_kv_ack, micro=False
            ),
        )

    async def on_ready(self) -> None:
        self.spawn(self._publish_results(), "results")
        self.spawn(self._heartbeats(), "heartbeats")
        self.spawn(self._publish_kv_results(), "kv-results")
        await self._heartbeat()

    async def drain(self, timeout: float) -> None:
        # the scheduler stops sending and moves its requests once what is in flight is back;
        # until it has read our draining heartbeat it may still send: wait for a quiet spell
        await self._heartbeat()
        deadline = time.monotonic() + timeout
        quiet_s = 2 * self.heartbeat_interval_s
        while time.monotonic() < deadline:
            quiet = time.monotonic() - self._scheduler_seen >= quiet_s
            queue = self.queue
            if quiet and queue.idle and queue.results.empty() and not self._publishing:
                return
            await asyncio.sleep(0.02)

    async def teardown(self) -> None:
        await asyncio.to_thread(self.queue.stop)
        if self.kv is not None:
            await asyncio.to_thread(self.kv.close)
        self.runner_host.close()
        self.telemetry.end_all()

    def metrics_registry(self) -> CollectorRegistry | None:
        return self.telemetry.registry

    def health_details(self) -> dict[str, Any]:
        runner = self.runner
        sim = {"simulated_s": runner.simulated_s} if isinstance(runner, SimRunner) else {}
        tails = self.runner_host.int4_tails()  # int4-delta: the pool above its reserve grew
        return {
            "worker_id": self.instance_id,
            "shard": self.shard_id,
            "simulated": self.simulated,
            **sim,
            "epoch": self.queue.epoch,
            "next_seq": self._next_done,
            "queued": self.queue.queued,
            "buffered": len(self.queue.pending),
            "batches": self.num_batches,
            "failed_batches": self.num_failed,
            # batches queued to run on the event loop (short CPU batches); the rest ran on
            # the compute thread
            "inline_batches": self.queue.num_inline_batches,
            # what the model runner did (passes, rows, time executing): for the bench and
            # for metrics; a new KV geometry starts a new runner, and these from zero
            "runner": runner.stats.snapshot() if runner is not None else {},
            "decode_s": self.decode_s,
            **({"kv_int4_tails": dataclasses.asdict(tails)} if tails is not None else {}),
            **(self.kv.health() if self.kv is not None else {}),
            **self.kv_outbox.health(),
        }

    # ------------------------------------------------------------------ heartbeats
    def heartbeat(self) -> WorkerHeartbeat:
        """``next_seq``: every batch before it ran and its result went out; ``missing_seq``:
        the batch this idle worker waits for (-1 when busy or waiting for nothing)."""
        started = self.queue.busy_since
        return WorkerHeartbeat(
            worker_id=self.instance_id,
            epoch=self.queue.epoch or "",
            next_seq=self._next_done,
            missing_seq=self.queue.missing_seq,
            busy_s=max(time.monotonic() - started, 1e-6) if started else 0.0,
            draining=self.draining,
            time=time.time(),
            shard_id=self.shard_id,
            simulated=self.simulated,
        )

    async def _heartbeat(self) -> None:
        try:
            await self.nc.publish(
                subjects.worker_heartbeat(self.shard_id), encode_msgpack(self.heartbeat())
            )
        except Exception as exc:  # bus trouble: the next beat tries again
            self.log.debug("heartbeat not sent", error=repr(exc))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            if self.bus_connected:
                await self._heartbeat()

    async def _on_discover(self, _msg: Msg) -> None:
        await self._heartbeat()

    # ------------------------------------------------------------------ receiving
    async def _on_batch(self, msg: Msg) -> None:
        data = self._batches_in.feed(msg)
        if data is None:
            return  # a part of a bigger batch
        t0 = time.perf_counter()
        try:
            wb = decode_msgpack(data, WorkerBatch)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable batch dropped", error=str(exc)[:200])
            return
        self.decode_s += time.perf_counter() - t0
        batch = wb.batch
        if wb.worker_id and wb.worker_id != self.instance_id:
            self.log.warning("batch for another worker dropped", worker=wb.worker_id)
            return
        if wb.epoch != self.queue.epoch:
            if _is_older_epoch(wb.epoch, self.queue.epoch):
                self.log.warning("batch of an older epoch dropped", epoch=wb.epoch)
                return
            scheduler = wb.epoch.rpartition(".")[0]
            if not await self._may_serve(scheduler):
                await self._refuse(wb, msg.reply, f"bound to scheduler {self._scheduler}")
                return
            self._scheduler = scheduler
            # a new scheduler incarnation, or the scheduler recovering from a worker loss:
            # the device state starts over at the epoch's first seq (waited for if lost)
            start = wb.epoch_start_seq
            first = start if start is not None and 0 <= start <= batch.seq else batch.seq
            self.log.info("new scheduler epoch", epoch=wb.epoch, first_seq=first)
            self.queue.new_epoch(wb.epoch, first)
            self._next_done = first
            self.telemetry.end_all()
        self._scheduler_seen = time.monotonic()
        if self.queue.is_duplicate(batch.seq):
            self.log.warning("duplicate batch dropped", **{BATCH_SEQ: batch.seq})
            return
        if batch.kv_pulls and self.kv is not None:
            # where their sources are: asked now, answered while the batch waits its turn
            self.kv.prepare(batch.kv_pulls)
        reply = msg.reply or subjects.worker_result(wb.epoch)  # where its scheduler listens
        run = BatchRun(wb, reply, time.perf_counter())
        self._log_requests(batch)
        self.telemetry.on_batch(batch)
        self.queue.add(run)

    async def _may_serve(self, scheduler: str) -> bool:
        """Whether batches of ``scheduler`` may reset us: we serve nobody yet, we serve it
        already, or the one we serve has no connection any more (nats-server answers its
        alive subject with "no responders")."""
        bound = self._scheduler
        if bound is None or bound == scheduler:
            return True
        if time.monotonic() - self._scheduler_seen > _BOUND_IDLE_S:
            # it left us (bound another worker): should it come back, it is refused now
            self.log.info("bound scheduler idle; serving another", old=bound, new=scheduler)
            return True
        try:
            await self.nc.request(subjects.sched_alive(bound), b"", timeout=0.5)
        except NoRespondersError:
            self.log.info("bound scheduler is gone; serving another", old=bound, new=scheduler)
            return True
        except Exception:  # connected but not answering (stalled): still ours
            return False
        return False

    async def _refuse(self, wb: WorkerBatch, reply: str | None, why: str) -> None:
        self.log.warning("batch of another scheduler refused", epoch=wb.epoch, reason=why)
        if not reply:
            return
        out = WorkerResult(
            epoch=wb.epoch,
            result=BatchResult(seq=wb.batch.seq),
            worker_id=self.instance_id,
            refused=why,
        )
        try:
            await self.nc.publish(reply, encode_msgpack(out))
        except Exception as exc:
            self.log.warning("refusal not sent", error=repr(exc)[:200])

    def _log_requests(self, batch: Batch) -> None:
        for new in batch.new_requests:
            self.log.info(
                "request loaded",
                num_prompt_tokens=len(new.prompt_token_ids),
                **{BATCH_SEQ: batch.seq},
                **request_fields(new.request_id, batch.trace_ids.get(new.request_id, "")),
            )
        for rid in batch.finished_request_ids:
            self.log.info("request released", request_id=rid, **{BATCH_SEQ: batch.seq})

    # ------------------------------------------------------------------ disaggregation
    def _before_execute(self, runner: Any, wb: WorkerBatch) -> None:
        """Just before a batch runs (compute thread or loop): its KV pulls start, on the
        transfer thread, and a new runner's KV is offered to peers."""
        if self.kv is not None:
            self.kv.before_batch(runner, wb.epoch, wb.kv_layout, wb.batch.kv_pulls)

    def _retire_kv(self) -> None:
        """On the compute thread, before a new runner is built: the old one's KV leaves
        NIXL (its pulls end) so that it is freed with the runner."""
        if self.kv is not None:
            self.kv.retire()

    async def _on_kv_meta(self, msg: Msg) -> None:
        if not msg.reply or self.kv is None:
            return
        if not self.kv_transfer:
            info = KVSourceInfo(
                agent_name="", agent_metadata=b"", epoch="", layout=NO_LAYOUT,
                arena_addresses=[], num_blocks=0, block_bytes=0,
                error="this worker was started without KV transfer (--role)",
            )  # fmt: skip
        else:
            info = await self.kv.source_info()
        await self.nc.publish(msg.reply, encode_msgpack(info))

    async def _fetch_kv_source(self, worker_id: str, timeout: float) -> KVSourceInfo | None:
        try:
            reply = await self.nc.request(subjects.worker_kv_meta(worker_id), b"", timeout=timeout)
            return decode_msgpack(reply.data, KVSourceInfo)
        except (NatsError, TimeoutError, msgspec.DecodeError) as exc:
            self.log.warning("KV source not found", worker=worker_id, error=repr(exc)[:200])
            return None

    async def _publish_kv_results(self) -> None:
        """Publishes each pull's result, and again with backoff until the scheduler
        acknowledges it (``result_outbox.py``)."""
        assert self.kv is not None
        results, outbox = self.kv.results, self.kv_outbox
        while True:
            wait = outbox.wait_s(time.monotonic())
            try:
                epoch, result = await asyncio.wait_for(results.get(), wait)
            except TimeoutError:
                pass
            else:
                outbox.add(epoch, result, time.monotonic())
                while not results.empty():  # whatever else is done goes along
                    outbox.add(*results.get_nowait(), time.monotonic())
            for epoch, due in outbox.due(time.monotonic()).items():
                await self._send_kv_results(epoch, due)

    async def _send_kv_results(self, epoch: str, results: list[KVPullResult]) -> None:
        if self._drop_kv_results > 0:  # tests only: this publication is lost on the way
            self._drop_kv_results -= 1
            self.log.warning("KV pull results dropped (test)", n=len(results))
            return
        out = KVPullResults(epoch=epoch, worker_id=self.instance_id, results=results)
        try:
            await self.nc.publish(
                subjects.worker_kv_results(epoch),
                encode_msgpack(out),
                reply=subjects.worker_kv_ack(self.instance_id),
            )
        except Exception as exc:  # sent again until acknowledged
            self.log.warning("KV pull results not sent", error=repr(exc)[:200])

    async def _on_kv_ack(self, msg: Msg) -> None:
        try:
            ack = decode_msgpack(msg.data, KVPullResultsAck)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable KV results ack", error=str(exc)[:200])
            return
        self.kv_outbox.confirm(ack.transfer_ids)

    # ------------------------------------------------------------------ results
    async def _publish_results(self) -> None:
        while True:
            run, result, elapsed = await self.queue.results.get()
            seq = run.wb.batch.seq
            if run.wb.epoch != self.queue.epoch:
                continue
            self._next_done = seq + 1
            self.num_batches += 1
            if result.error is None and run.passes is not None:
                self.telemetry.on_executed(run.passes, elapsed)
            out = WorkerResult(
                epoch=run.wb.epoch,
                result=result,
                worker_id=self.instance_id,
                execute_s=elapsed,
                worker_s=time.perf_counter() - run.arrived,
                simulated=self.simulated,
            )
            self._publishing = True
            try:
                await publish_chunked(self.nc, run.reply, encode_msgpack(out))
            except Exception as exc:  # lost: the scheduler learns it from our heartbeat
                self.log.warning("result not sent", error=repr(exc)[:200], **{BATCH_SEQ: seq})
            finally:
                self._publishing = False
            if result.error is not None:
                self.num_failed += 1
                self.log.error("batch failed", error=result.error[:500], **{BATCH_SEQ: seq})
            else:
                self.log.debug(
                    "batch done",
                    rows=len(run.wb.batch.rows),
                    execute_ms=round(elapsed * 1e3, 3),
                    **{BATCH_SEQ: seq},
                )


# CPU batches expected to run under this run on the event loop: short enough that heartbeats
# and health answers are late by a few ms at most (a scheduler waits 3 s for a heartbeat)
INLINE_MAX_S = 0.02

NO_LAYOUT = KVLayoutInfo(
    kv_layout="", block_size=0, num_planes=0, num_layers=0, num_kv_heads=0, head_dim=0, dtype=""
)

# a scheduler that sent us nothing for this long has moved on: another may take us
_BOUND_IDLE_S = 30.0


def _is_older_epoch(epoch: str, current: str | None) -> bool:
    """``<scheduler instance>.<epoch number>``: an older epoch of the same scheduler is a
    late message from before a reset. Different schedulers are not ordered: the newest
    message wins (one scheduler at a time drives a worker)."""
    if current is None:
        return False
    inst, _, num = epoch.rpartition(".")
    cur_inst, _, cur_num = current.rpartition(".")
    if inst != cur_inst or not num.isdigit() or not cur_num.isdigit():
        return False
    return int(num) < int(cur_num)
