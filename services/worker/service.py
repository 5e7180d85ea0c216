"""Worker actor: owns the model and a ``ModelRunner``; executes batches strictly in seq order.

Batches arrive on ``rlt.v1.worker.batch`` (msgpack ``WorkerBatch``); a batch that arrives
early waits in a buffer until its predecessors ran. Execution happens in a one-thread
executor so the event loop stays free (health pings, buffering the next batch while this
one runs). A batch that raises is answered with ``BatchResult(error=...)``, never a crash.
The result goes to the batch's reply subject (the scheduler epoch's result subject).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import torch
from nats.aio.msg import Msg

from messages.batch import Batch, BatchResult
from messages.internal import WorkerBatch, WorkerResult
from services.runtime import subjects
from services.runtime.bus import decode_msgpack, encode_msgpack
from services.runtime.logging import BATCH_SEQ, request_fields
from services.runtime.service import Endpoint, Service
from services.scheduler.config import KVLayout, SchedulerConfig
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner


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
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.checkpoint = Path(checkpoint)
        self.config = config or SchedulerConfig()
        self.device = device
        self.dtype = dtype
        self.model: OuroModel | None = None
        self.runner: ModelRunner | None = None
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
        return (Endpoint("batch", subjects.WORKER_BATCH, self._on_batch),)

    async def on_ready(self) -> None:
        self.spawn(self._run(), "executor")

    async def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (self._busy or self._expected in self._pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def teardown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def health_details(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "next_seq": self._expected,
            "buffered": len(self._pending),
            "batches": self.num_batches,
            "failed_batches": self.num_failed,
        }

    # ------------------------------------------------------------------ receiving
    async def _on_batch(self, msg: Msg) -> None:
        try:
            wb = decode_msgpack(msg.data, WorkerBatch)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable batch dropped", error=str(exc))
            return
        batch = wb.batch
        if wb.epoch != self._epoch:
            # a new scheduler incarnation: its first batch sets where the sequence starts
            # (0 normally; later if this worker joined a running scheduler)
            self.log.info("new scheduler epoch", epoch=wb.epoch, first_seq=batch.seq)
            self._epoch = wb.epoch
            self._expected = batch.seq
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
                try:
                    used = self.runner is not None and self.runner.last_seq >= 0
                    if (self._needs_reset and used) or self._geometry_of(wb) != self._geometry:
                        num_blocks, block_size, layout = self._geometry_of(wb)
                        await loop.run_in_executor(
                            self._pool, self._make_runner, num_blocks, block_size, layout
                        )
                    self._needs_reset = False
                    t0 = time.perf_counter()
                    result = await loop.run_in_executor(self._pool, self._execute, wb.batch)
                    elapsed = time.perf_counter() - t0
                finally:
                    self._busy = False
                if epoch != self._epoch:
                    break  # the scheduler restarted while this ran; its result is moot
                self._expected += 1
                self.num_batches += 1
                out = WorkerResult(
                    epoch=wb.epoch, result=result, worker_id=self.instance_id, execute_s=elapsed
                )
                await self.nc.publish(reply, encode_msgpack(out))
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

    def _make_runner(self, num_blocks: int, block_size: int, kv_layout: str) -> None:
        # runs in the executor thread: allocating device KV can take a while
        assert self.model is not None
        self.runner = None  # free the old KV before allocating the new one
        self.runner = ModelRunner(self.model, num_blocks, block_size, KVLayout(kv_layout))
        self._geometry = (num_blocks, block_size, kv_layout)

    def _execute(self, batch: Batch) -> BatchResult:
        assert self.runner is not None
        try:
            return self.runner.execute(batch)
        except Exception as exc:
            return BatchResult(seq=batch.seq, error=f"{type(exc).__name__}: {exc}")
