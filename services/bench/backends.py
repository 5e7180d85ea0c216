"""Drivers that play a workload against an engine and record what each request saw.

Two backends behind one interface (``run(workload, config) -> RunRecord``):
``InProcessBackend`` steps ``LLMEngine`` directly; ``PipelineBackend`` (``pipeline.py``)
sends the same requests over a real nats-server to the four services. Both time tokens on
the client's side of their interface and count passes at the model runner.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.bench.metrics import RequestRecord, RunRecord, WasteCounters, own_cpu_s
from services.bench.probe import RunnerProbe, StatsProbe
from services.bench.workloads import LoopMode, RequestSpec, Workload
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner
from services.worker.sim import SimRunner


class BenchError(RuntimeError):
    """A run that cannot be measured honestly (an error event, a stall)."""


class Backend(Protocol):
    name: str

    def run(self, workload: Workload, config: SchedulerConfig) -> RunRecord: ...

    def close(self) -> None: ...


def sampling_params(spec: RequestSpec, workload: Workload) -> SamplingParams:
    # greedy and ignore_eos: every arm produces exactly the same tokens (a request with stop
    # ids stops at the same one in every arm, the scheduler cannot know where in advance)
    return SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=list(spec.stop_token_ids),
        min_loops=workload.exit.min_loops,
        exit_threshold=workload.exit.exit_threshold,
    )


def waste_counters(engine: LLMEngine) -> WasteCounters:
    s = engine.scheduler.stats
    return WasteCounters(
        preemptions=s.num_preemptions,
        recomputed_prompt_tokens=s.num_recomputed_prompt_tokens,
        recomputed_prompt_token_loops=s.num_recomputed_prompt_token_loops,
        recomputed_decode_loops=s.num_recomputed_decode_loops,
        reserved_blocks=s.num_reserved_blocks,
        reserved_unused_blocks=s.num_reserved_unused_blocks,
    )


class InProcessBackend:
    """``LLMEngine`` in this process; the model is loaded once and shared by every run.
    ``codec``: the checkpoint's tokenizer, so that token events carry text, as they do from
    ``rlt generate --offline`` and from the scheduler service (the pipeline arms' baseline
    must do the work the pipeline does). ``simulated``: batches run on the simulated device
    (passes timed as Ouro-1.4B's on an H200, no model computed; ``services/worker/sim.py``),
    never a default."""

    name = "in-process"

    def __init__(
        self, model: OuroModel, *, codec: TextCodec | None = None, simulated: bool = False
    ) -> None:
        self.model = model
        self.codec = codec
        self.simulated = simulated

    def close(self) -> None:
        pass

    def engine(self, config: SchedulerConfig) -> LLMEngine:
        """A fresh engine for one run."""
        sim = SimRunner.h200(self.model.cfg) if self.simulated else None
        return LLMEngine(self.model, config, codec=self.codec, simulated=sim)

    def run(self, workload: Workload, config: SchedulerConfig) -> RunRecord:
        engine = self.engine(config)
        specs = workload.requests
        ids = [f"bench-{i}" for i in range(len(specs))]
        index = {rid: i for i, rid in enumerate(ids)}
        records: list[RequestRecord | None] = [None] * len(specs)
        unsent = deque(range(len(specs)))
        finished = 0

        def send(i: int, due: float) -> None:
            spec = specs[i]
            engine.add_request(ids[i], list(spec.prompt_token_ids), sampling_params(spec, workload))
            records[i] = RequestRecord(
                arrival=due, num_prompt_tokens=spec.num_prompt_tokens, kind=spec.kind
            )
            records[i].sent_step = steps

        runner = engine.runner
        probe = RunnerProbe(runner) if isinstance(runner, ModelRunner) else StatsProbe(runner)
        steps = 0  # engine steps so far: the schedule's clock (RequestRecord.sent_step)
        with probe:
            cpu_before = own_cpu_s()
            start = time.perf_counter()
            if workload.mode == LoopMode.CLOSED:
                for _ in range(min(workload.concurrency, len(unsent))):
                    send(unsent.popleft(), start)
            while finished < len(specs):
                if workload.mode == LoopMode.OPEN:
                    now = time.perf_counter()
                    while unsent and start + specs[unsent[0]].arrival_s <= now:
                        i = unsent.popleft()
                        send(i, start + specs[i].arrival_s)  # TTFT counts from when it was due
                if not engine.has_unfinished_requests():
                    if workload.mode == LoopMode.OPEN and unsent:
                        due = start + specs[unsent[0]].arrival_s
                        time.sleep(max(0.0, due - time.perf_counter()))
                        continue
                    raise BenchError("the engine went idle with requests outstanding")
                events = engine.step()
                t = time.perf_counter()
                steps += 1
                for event in events:
                    rec = records[index[event.request_id]]
                    assert rec is not None
                    if isinstance(event, TokenEvent):
                        if not rec.token_times:
                            rec.first_token_step = steps
                        rec.token_times.append(t)
                    elif isinstance(event, FinishedEvent):
                        finish_record(rec, event, t)
                        rec.finish_step = steps
                        finished += 1
                        if workload.mode == LoopMode.CLOSED and unsent:
                            send(unsent.popleft(), t)
                    elif isinstance(event, ErrorEvent):
                        raise BenchError(f"{event.request_id}: [{event.code}] {event.message}")
            end = time.perf_counter()
            cpu_after = own_cpu_s()
        requests = [r for r in records if r is not None]
        return RunRecord(
            start,
            end,
            requests,
            probe.counters,
            # requests admitted ahead of one the KV policy refused (max_admission_bypasses):
            # counted passes and backfills
            extra={
                "admission_bypasses": engine.scheduler.stats.num_admission_bypasses,
                "admission_backfills": engine.scheduler.stats.num_admission_backfills,
            },
            waste=waste_counters(engine),
            cpu_before={"engine": cpu_before},
            cpu_after={"engine": cpu_after},
        )


def finish_record(rec: RequestRecord, event: FinishedEvent, t: float) -> None:
    if len(event.token_ids) != len(rec.token_times):
        raise BenchError(
            f"{event.request_id}: {len(rec.token_times)} token events for "
            f"{len(event.token_ids)} tokens"
        )
    rec.finish_time = t
    rec.num_cached_tokens = event.num_cached_tokens
    rec.exit_depths = list(event.exit_depths)
    rec.shard = event.shard
