"""Worker actor: owns the model and a ``ModelRunner``; executes batches strictly in seq order.

Batches arrive on ``rlt.v1.worker.batch.<this instance>`` (msgpack ``WorkerBatch``; a scheduler
binds to one worker at a time, see ``services/scheduler/liveness.py``); a batch that arrives
early waits in a buffer until its predecessors ran. Execution happens in a one-thread
executor so the event loop stays free (heartbeats, health pings, buffering the next batch
while this one runs). A batch that raises is answered with ``BatchResult(error=...)``, never a
crash. The result goes to the batch's reply subject (the scheduler epoch's result subject).

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
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import torch
from nats.aio.msg import Msg

from messages.batch import Batch, BatchResult
from messages.internal import WorkerBatch, WorkerHeartbeat, WorkerResult
from services.common.config import KVLayout, SchedulerConfig
from services.common.model_config import OuroConfig
from services.runtime import subjects
from services.runtime.bus import Reassembler, decode_msgpack, encode_msgpack, publish_chunked
from services.runtime.logging import BATCH_SEQ, request_fields
from services.runtime.service import Endpoint, Service
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner
from services.worker.sim import SimCostModel, SimRunner

SIM_DEVICE = "sim"


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
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.shard_id = subjects.check_shard_id(shard_id)
        self.heartbeat_interval_s = heartbeat_interval_s
        self._batches_in = Reassembler()
        self._busy_since = 0.0
        self.checkpoint = Path(checkpoint)
        self.config = config or SchedulerConfig()
        self.device = device
        self.dtype = dtype
        self.model: OuroModel | None = None
        self.runner: ModelRunner | SimRunner | None = None
        self.simulated = device == SIM_DEVICE
        self._sim_config: OuroConfig | None = None
        self._geometry: tuple[int, int, str] = (0, 0, "")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlt-worker")
        self._epoch: str | None = None
        self._expected = 0
        self._needs_reset = False
        self._pending: dict[int, tuple[WorkerBatch, str]] = {}
        self._wake = asyncio.Event()
        self._busy = False
        self.num_batches = 0
        self.num_failed = 0

    async def setup(self) -> None:
        loop = asyncio.get_running_loop()
        if self.simulated:
            # no weights: the checkpoint's config gives depths, vocabulary and EOS ids
            self._sim_config = OuroConfig.from_checkpoint(self.checkpoint)
            cfg = self.config
            self._make_runner(cfg.num_blocks, cfg.block_size, str(cfg.kv_layout))
            self.log.warning(
                "SIMULATED device: no model runs; every output is simulated (benchmarks only)",
                dilation=self.runner.cost.dilation,  # type: ignore[union-attr]
            )
            return
        self.model = await loop.run_in_executor(
            self._pool,
            lambda: OuroModel.from_checkpoint(
                self.checkpoint, dtype=self.dtype, device=self.device
            ),
        )
        cfg = self.config
        await loop.run_in_executor(
            self._pool, self._make_runner, cfg.num_blocks, cfg.block_size, str(cfg.kv_layout)
        )
        self.log.info("model loaded", checkpoint=str(self.checkpoint), device=self.device)

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
        )

    async def on_ready(self) -> None:
        self.spawn(self._run(), "executor")
        self.spawn(self._heartbeats(), "heartbeats")
        await self._heartbeat()

    async def drain(self, timeout: float) -> None:
        # the scheduler stops sending and moves its requests once what is in flight is back
        await self._heartbeat()
        deadline = time.monotonic() + timeout
        while (self._busy or self._expected in self._pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def teardown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def health_details(self) -> dict[str, Any]:
        runner = self.runner
        sim = {"simulated_s": runner.simulated_s} if isinstance(runner, SimRunner) else {}
        return {
            "worker_id": self.instance_id,
            "shard": self.shard_id,
            "simulated": self.simulated,
            **sim,
            "epoch": self._epoch,
            "next_seq": self._expected,
            "buffered": len(self._pending),
            "batches": self.num_batches,
            "failed_batches": self.num_failed,
            # what the model runner did (passes, rows, time executing): for the bench and
            # for metrics; a new KV geometry starts a new runner, and these from zero
            "runner": self.runner.stats.snapshot() if self.runner is not None else {},
        }

    # ------------------------------------------------------------------ heartbeats
    def heartbeat(self) -> WorkerHeartbeat:
        idle = not self._busy
        waiting = idle and self._epoch is not None and self._expected not in self._pending
        return WorkerHeartbeat(
            worker_id=self.instance_id,
            epoch=self._epoch or "",
            next_seq=self._expected,
            missing_seq=self._expected if waiting else -1,
            busy_s=0.0 if idle else max(time.monotonic() - self._busy_since, 1e-6),
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
        try:
            wb = decode_msgpack(data, WorkerBatch)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable batch dropped", error=str(exc)[:200])
            return
        batch = wb.batch
        if wb.worker_id and wb.worker_id != self.instance_id:
            self.log.warning("batch for another worker dropped", worker=wb.worker_id)
            return
        if wb.epoch != self._epoch:
            if _is_older_epoch(wb.epoch, self._epoch):
                self.log.warning("batch of an older epoch dropped", epoch=wb.epoch)
                return
            # a new scheduler incarnation, or the scheduler recovering from a worker loss:
            # the device state starts over at the epoch's first seq (waited for if lost)
            first = wb.epoch_start_seq if 0 <= wb.epoch_start_seq <= batch.seq else batch.seq
            self.log.info("new scheduler epoch", epoch=wb.epoch, first_seq=first)
            self._epoch = wb.epoch
            self._expected = first
            self._pending.clear()
            self._needs_reset = True
        if batch.seq < self._expected or batch.seq in self._pending:
            self.log.warning("duplicate batch dropped", **{BATCH_SEQ: batch.seq})
            return
        self._pending[batch.seq] = (wb, msg.reply or subjects.WORKER_RESULT)
        self._log_requests(batch)
        self._wake.set()

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

    # ------------------------------------------------------------------ executing
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._expected in self._pending:
                epoch = self._epoch
                wb, reply = self._pending.pop(self._expected)
                self._busy = True
                self._busy_since = time.monotonic()
                t0 = time.perf_counter()
                try:
                    used = self.runner is not None and self.runner.last_seq >= 0
                    if (self._needs_reset and used) or self._geometry_of(wb) != self._geometry:
                        num_blocks, block_size, layout = self._geometry_of(wb)
                        self._check_geometry(num_blocks, block_size, layout)
                        await loop.run_in_executor(
                            self._pool, self._make_runner, num_blocks, block_size, layout
                        )
                    self._needs_reset = False
                    t0 = time.perf_counter()
                    result = await loop.run_in_executor(self._pool, self._execute, wb.batch)
                except Exception as exc:  # a bad batch never stops the executor loop
                    result = BatchResult(seq=wb.batch.seq, error=f"{type(exc).__name__}: {exc}")
                finally:
                    self._busy = False
                elapsed = time.perf_counter() - t0
                if epoch != self._epoch:
                    break  # the scheduler restarted while this ran; its result is moot
                self._expected += 1
                self.num_batches += 1
                out = WorkerResult(
                    epoch=wb.epoch,
                    result=result,
                    worker_id=self.instance_id,
                    execute_s=elapsed,
                    simulated=self.simulated,
                )
                try:
                    await publish_chunked(self.nc, reply, encode_msgpack(out))
                except Exception as exc:  # lost: the scheduler learns it from our heartbeat
                    self.log.warning(
                        "result not sent", error=repr(exc)[:200], **{BATCH_SEQ: wb.batch.seq}
                    )
                if result.error is not None:
                    self.num_failed += 1
                    self.log.error(
                        "batch failed", error=result.error[:500], **{BATCH_SEQ: wb.batch.seq}
                    )
                else:
                    self.log.debug(
                        "batch done",
                        rows=len(wb.batch.rows),
                        execute_ms=round(elapsed * 1e3, 3),
                        **{BATCH_SEQ: wb.batch.seq},
                    )

    def _geometry_of(self, wb: WorkerBatch) -> tuple[int, int, str]:
        if wb.num_blocks and wb.block_size and wb.kv_layout:
            return wb.num_blocks, wb.block_size, wb.kv_layout
        return self._geometry

    def _check_geometry(self, num_blocks: int, block_size: int, kv_layout: str) -> None:
        """Refuses a KV geometry that cannot be allocated, instead of dying trying."""
        KVLayout(kv_layout)  # ValueError for an unknown layout
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"bad KV geometry: {num_blocks} blocks of {block_size}")
        if self.simulated:
            return  # no device memory
        assert self.model is not None
        cfg = self.model.cfg
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim
        need = num_blocks * per_block * elem
        limit = _kv_memory_limit(self.device, self._kv_bytes())
        if need > limit:
            raise MemoryError(
                f"KV cache of {num_blocks} blocks x {block_size} needs {need / 2**30:.2f} GiB, "
                f"only {limit / 2**30:.2f} GiB available (RLT_WORKER_MAX_KV_BYTES)"
            )

    def _kv_bytes(self) -> int:
        if not isinstance(self.runner, ModelRunner):
            return 0
        return 2 * self.runner.k_cache.numel() * self.runner.k_cache.element_size()

    def _make_runner(self, num_blocks: int, block_size: int, kv_layout: str) -> None:
        # runs in the executor thread: allocating device KV can take a while
        self.runner = None  # free the old KV before allocating the new one
        if self.simulated:
            assert self._sim_config is not None
            dilation = float(os.environ.get("RLT_SIM_DILATION", "1"))
            # always Ouro-1.4B on an H200, whatever checkpoint supplies vocab and depths
            shape = _ouro_1_4b_config()
            self.runner = SimRunner(
                self._sim_config, SimCostModel.for_model(shape, dilation=dilation)
            )
        else:
            assert self.model is not None
            self.runner = ModelRunner(self.model, num_blocks, block_size, KVLayout(kv_layout))
        self._geometry = (num_blocks, block_size, kv_layout)

    def _execute(self, batch: Batch) -> BatchResult:
        assert self.runner is not None
        try:
            return self.runner.execute(batch)
        except Exception as exc:
            return BatchResult(seq=batch.seq, error=f"{type(exc).__name__}: {exc}")


def _ouro_1_4b_config() -> OuroConfig:
    from services.worker.model.toy import toy_config

    return toy_config("1.4b")


def _is_older_epoch(epoch: str, current: str | None) -> bool:
    """``<scheduler instance>.<generation>``: an older generation of the same scheduler is a
    late message from before a reset. Different schedulers are not ordered: the newest
    message wins (one scheduler at a time drives a worker)."""
    if current is None:
        return False
    inst, _, gen = epoch.rpartition(".")
    cur_inst, _, cur_gen = current.rpartition(".")
    if inst != cur_inst or not gen.isdigit() or not cur_gen.isdigit():
        return False
    return int(gen) < int(cur_gen)


def _kv_memory_limit(device: str, current_kv_bytes: int) -> int:
    """Bytes a new KV cache may take: ``RLT_WORKER_MAX_KV_BYTES`` if set, else what the
    device has free (plus the cache being replaced), with some headroom."""
    configured = os.environ.get("RLT_WORKER_MAX_KV_BYTES")
    if configured:
        return int(configured)
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(0.95 * (free + current_kv_bytes))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(0.8 * (int(line.split()[1]) * 1024 + current_kv_bytes))
    except OSError:
        pass
    return 1 << 62  # unknown platform: no check
