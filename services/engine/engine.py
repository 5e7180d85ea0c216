"""The in-process engine: scheduler + model runner in one process, no NATS.

It drives the same three scheduler calls the services use (``schedule``,
``update_after_submission``, ``update_from_output``). With async scheduling it keeps up
to ``max_inflight_batches`` batches submitted before applying the oldest result, which
exercises submission-time progress exactly as the pipeline does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from messages.api import FinishedEvent, StreamEvent
from messages.batch import BatchResult
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.scheduler.batch import ScheduledBatch
from services.scheduler.scheduler import Scheduler
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner


def model_limits(model: OuroModel) -> ModelLimits:
    return ModelLimits.from_model_config(model.cfg)


@dataclass
class _Inflight:
    batch: ScheduledBatch
    result: BatchResult


class LLMEngine:
    def __init__(
        self,
        model: OuroModel,
        config: SchedulerConfig,
        *,
        on_batch: Callable[[ScheduledBatch], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.scheduler = Scheduler(config, model_limits(model))
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
        self._inflight: deque[_Inflight] = deque()
        self._on_batch = on_batch

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: SchedulerConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        on_batch: Callable[[ScheduledBatch], None] | None = None,
    ) -> LLMEngine:
        model = OuroModel.from_checkpoint(checkpoint_dir, dtype=dtype, device=device)
        return cls(model, config, on_batch=on_batch)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> list[StreamEvent]:
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StreamEvent]:
        """Submits batches (up to the in-flight limit), then applies the oldest result."""
        events: list[StreamEvent] = []
        limit = self.config.max_inflight_batches if self.config.async_scheduling else 1
        while len(self._inflight) < limit:
            batch = self.scheduler.schedule()
            if batch is None:
                break
            if self._on_batch is not None:
                self._on_batch(batch)
            self.scheduler.update_after_submission(batch)
            # the worker runs batches strictly in seq order; in-process that is right now
            try:
                result = self.runner.execute(batch.wire)
            except Exception as exc:  # a failed batch ends its requests, never the engine
                result = BatchResult(seq=batch.seq, error=f"{type(exc).__name__}: {exc}")
            self._inflight.append(_Inflight(batch, result))
        if self._inflight:
            done = self._inflight.popleft()
            if done.result.error is not None:
                events.extend(self.scheduler.fail_batch(done.batch, done.result.error))
            else:
                events.extend(self.scheduler.update_from_output(done.batch, done.result))
        return events

    def run_until_done(self, max_steps: int = 1_000_000) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for _ in range(max_steps):
            if not self.has_unfinished_requests():
                return events
            events.extend(self.step())
        raise RuntimeError(f"engine did not finish within {max_steps} steps")

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[FinishedEvent]:
        """Runs the prompts to completion; returns their finished events in input order."""
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        ids = [f"req-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, param_list, strict=True):
            self.add_request(request_id, list(prompt), p)
        finished = {e.request_id: e for e in self.run_until_done() if isinstance(e, FinishedEvent)}
        return [finished[i] for i in ids]
