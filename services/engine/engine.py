"""The in-process engine: ``EngineCore`` driving a model runner in this process, no NATS.

It is the same step loop the scheduler service runs (``services/scheduler/engine_core.py``)
with the in-process executor, so offline runs, traces, the bench's in-process arm and the
oracle tests exercise exactly what the services run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from messages.api import FinishedEvent, StreamEvent
from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.common.structured.grammar import check_structured_output, with_backend
from services.common.tokenizer import TextCodec
from services.engine.executor import InProcessExecutor
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.engine_core import EngineCore
from services.worker.model.ouro import OuroModel
from services.worker.passes.static_decode import DecodeMode
from services.worker.runner import ModelRunner
from services.worker.sampling.grammar import GrammarBook
from services.worker.sim import SimRunner


def model_limits(model: OuroModel) -> ModelLimits:
    return ModelLimits.from_model_config(model.cfg)


class LLMEngine:
    def __init__(
        self,
        model: OuroModel,
        config: SchedulerConfig,
        *,
        codec: TextCodec | None = None,
        on_batch: Callable[[ScheduledBatch], None] | None = None,
        simulated: SimRunner | None = None,
        decode_mode: DecodeMode | None = None,
    ) -> None:
        """``simulated``: batches run on the simulated device instead of ``model`` (the
        bench's GPU-like arms; ``model`` then only supplies the limits). ``codec``: the
        checkpoint's tokenizer, for text and structured outputs."""
        self.model = model
        self.config = config
        limits = model_limits(model)
        self.grammars = (
            GrammarBook(
                codec,
                model.cfg.vocab_size,
                limits.eos_token_ids,
                backend=config.structured_outputs_backend,
            )
            if codec
            else None
        )
        self.runner: ModelRunner | SimRunner = simulated or ModelRunner(
            model,
            config.num_blocks,
            config.block_size,
            config.kv_layout,
            decode_mode=decode_mode,
            grammars=self.grammars,
            kv_cache_dtype=config.kv_cache_dtype,
            kv_int4_anchor_every=config.kv_int4_anchor_every,
            batch_limits=config.batch_limits,
        )
        self.core = EngineCore(
            config,
            limits,
            InProcessExecutor(self.runner),
            codec=codec,
            on_batch=on_batch,
        )

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        config: SchedulerConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        codec: TextCodec | None = None,
        on_batch: Callable[[ScheduledBatch], None] | None = None,
    ) -> LLMEngine:
        model = OuroModel.from_checkpoint(checkpoint_dir, dtype=dtype, device=device)
        return cls(model, config, codec=codec, on_batch=on_batch)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Raises RequestError for a request that cannot run (as admission would refuse it:
        a structured output that does not compile, or one without a tokenizer)."""
        if params.structured_output is not None:
            if self.grammars is None:
                raise RequestError("structured_output needs an engine with the tokenizer")
            params = with_backend(params, self.config.structured_outputs_backend)
            assert params.structured_output is not None
            check_structured_output(params.structured_output)
        self.core.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> list[StreamEvent]:
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StreamEvent]:
        return self.core.step()

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
