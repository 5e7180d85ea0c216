"""The NATS pipeline backend: a real nats-server and the four services, driven by a client.

Two ways to run the services, both started and stopped per run (so every run starts from
an empty scheduler and prefix index):
- ``processes=True``: one OS process per service (``rlt service NAME``), the deployment
  compose runs; the worker's counters come from its health reply;
- ``processes=False``: every service in this process's event loop (a reported extra: torch
  compute and the bus then share one interpreter).
The nats-server child process lives as long as the backend. The client sends each request
as JSON on ``rlt.v1.generate`` with its own reply subject and timestamps each streamed event
as it arrives.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats
import torch
from nats.aio.msg import Msg

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from services.bench.backends import BenchError, finish_record, sampling_params
from services.bench.metrics import EngineCounters, RequestRecord, RunRecord
from services.bench.probe import RunnerProbe, counters_between
from services.bench.processes import (
    ServiceProcesses,
    cpu_snapshot,
    step_timings,
    worker_runner_stats,
)
from services.bench.workloads import LoopMode, Workload, warmup_workload
from services.common.config import SchedulerConfig
from services.launcher import NatsServer, build_service, free_port
from services.runtime import subjects
from services.runtime.bus import encode_json, is_no_responders
from services.runtime.service import Service
from services.worker.service import WorkerService

_EVENTS = msgspec.json.Decoder(TokenEvent | FinishedEvent | ErrorEvent)


class PipelineBackend:
    name = "nats-pipeline"

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        run_timeout_s: float = 900.0,
        processes: bool = True,
    ) -> None:
        self.processes = processes
        self.checkpoint = Path(checkpoint)
        self.device = device
        self.dtype = dtype
        self.run_timeout_s = run_timeout_s
        self._server: NatsServer | None = None
        self._run_dir: tempfile.TemporaryDirectory[str] | None = None
        self._saved_run_dir: str | None = None

    def _ensure_server(self) -> NatsServer:
        if self._server is None:
            # the services' health identity files go to a private dir, not the shared /tmp
            self._run_dir = tempfile.TemporaryDirectory(prefix="rlt-bench-")
            self._saved_run_dir = os.environ.get("RLT_RUN_DIR")
            os.environ["RLT_RUN_DIR"] = self._run_dir.name
            self._server = NatsServer(host="127.0.0.1", port=free_port()).start()
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._run_dir is not None:
            if self._saved_run_dir is None:
                os.environ.pop("RLT_RUN_DIR", None)
            else:
                os.environ["RLT_RUN_DIR"] = self._saved_run_dir
            self._run_dir.cleanup()
            self._run_dir = None

    def run(self, workload: Workload, config: SchedulerConfig) -> RunRecord:
        server = self._ensure_server()
        if self.processes:
            return asyncio.run(self._run_processes(server, workload, config))
        return asyncio.run(self._run(server.url, workload, config))

    async def _run_processes(
        self, server: NatsServer, workload: Workload, config: SchedulerConfig
    ) -> RunRecord:
        url = server.url
        assert server.proc is not None
        # the simulated device at H200 pass times, as the in-process sim arm runs it
        env = {"RLT_SIM_DILATION": "1"} if self.device == "sim" else None
        procs = ServiceProcesses(
            url, self.checkpoint, config, device=self.device, dtype=self.dtype, env=env
        )
        with procs:
            nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
            try:
                # a fresh worker's first batches pay one-off costs: outside the timed run
                warmup = warmup_workload(workload, whole=self.device.startswith("cuda"))
                await asyncio.wait_for(_drive(url, warmup), self.run_timeout_s)
                before = await worker_runner_stats(nc)
                timings_before = await step_timings(nc)
                nats_pid = server.proc.pid
                try:
                    record = await asyncio.wait_for(
                        _drive(url, workload, lambda: cpu_snapshot(procs, nats_pid)),
                        timeout=self.run_timeout_s,
                    )
                except TimeoutError as exc:
                    raise BenchError(
                        f"pipeline run did not finish in {self.run_timeout_s:.0f}s"
                    ) from exc
                after = await worker_runner_stats(nc)
                timings_after = await step_timings(nc)
            finally:
                await nc.close()
        record.counters = counters_between(before, after)
        record.extra.update(step_breakdown(timings_before, timings_after, record.counters))
        return record

    def _services(self, url: str, config: SchedulerConfig) -> list[Service]:
        worker = WorkerService(url, self.checkpoint, config, device=self.device, dtype=self.dtype)
        # start order: the back end first, the public entry point last
        names = ("prefix-cache", "scheduler", "admission")
        return [worker, *(build_service(n, url, self.checkpoint, config) for n in names)]

    async def _run(self, url: str, workload: Workload, config: SchedulerConfig) -> RunRecord:
        services = self._services(url, config)
        started: list[Service] = []
        try:
            for service in services:
                await service.start()
                started.append(service)
            worker = services[0]
            assert isinstance(worker, WorkerService) and worker.runner is not None
            with RunnerProbe(worker.runner) as probe:
                record = await asyncio.wait_for(_drive(url, workload), timeout=self.run_timeout_s)
            record.counters = probe.counters
            return record
        except TimeoutError as exc:
            raise BenchError(f"pipeline run did not finish in {self.run_timeout_s:.0f}s") from exc
        finally:
            for service in reversed(started):
                await service.stop(drain_timeout=5.0)


def step_breakdown(
    before: dict[str, float], after: dict[str, float], counters: EngineCounters
) -> dict[str, float | None]:
    """Per batch, µs: the scheduler's step, encoding and publishing the batch, delivering
    the client events, the worker decoding it, and the NATS round trip (batch out, result
    back, minus the time the worker held it). The worker's idle time is host_us_per_batch."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches = max(counters.batches, 1)
    results = d.get("results", 0.0)
    return {
        "sched_step_us": d["step_s"] * 1e6 / batches,
        "sched_encode_us": d["encode_s"] * 1e6 / batches,
        "sched_publish_us": d["publish_s"] * 1e6 / batches,
        "sched_deliver_us": d["deliver_s"] * 1e6 / batches,
        "worker_decode_us": d["decode_s"] * 1e6 / batches,
        "nats_round_trip_us": (
            (d["round_trip_s"] - d["worker_s"]) * 1e6 / results if results else None
        ),
    }


async def _drive(
    url: str, workload: Workload, cpu: Callable[[], dict[str, float]] | None = None
) -> RunRecord:
    """Plays the workload as a NATS client; returns what each request saw, and when.
    ``cpu``: a CPU snapshot taken when the clock starts and when it stops (the record's
    ``cpu_before`` / ``cpu_after``), so CPU and wall time cover the same window."""
    cpu_before: dict[str, float] = {}
    specs = workload.requests
    tag = uuid.uuid4().hex[:8]
    records: list[RequestRecord | None] = [None] * len(specs)
    unsent = deque(range(len(specs)))
    done = asyncio.Event()
    state: dict[str, object] = {"finished": 0, "failure": None}
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        prefix = nc.new_inbox()

        async def send(i: int, due: float) -> None:
            spec = specs[i]
            p = sampling_params(spec, workload)
            req = GenerateRequest(
                request_id=f"bench-{tag}-{i}",
                prompt_token_ids=list(spec.prompt_token_ids),
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                min_loops=p.min_loops,
                exit_threshold=p.exit_threshold,
                ignore_eos=p.ignore_eos,
                stop_token_ids=p.stop_token_ids,
            )
            records[i] = RequestRecord(
                arrival=due, num_prompt_tokens=spec.num_prompt_tokens, kind=spec.kind
            )
            await nc.publish(subjects.GENERATE, encode_json(req), reply=f"{prefix}.{i}")

        def fail(message: str) -> None:
            state["failure"] = message
            done.set()

        async def on_msg(msg: Msg) -> None:
            t = time.perf_counter()
            rec = records[int(msg.subject.rsplit(".", 1)[1])]
            assert rec is not None
            if is_no_responders(msg):
                fail("no rlt service answered rlt.v1.generate")
                return
            event = _EVENTS.decode(msg.data)
            if isinstance(event, TokenEvent):
                rec.token_times.append(t)
            elif isinstance(event, ErrorEvent):
                fail(f"{event.request_id}: [{event.code}] {event.message}")
            else:
                try:
                    finish_record(rec, event, t)
                except BenchError as exc:
                    fail(str(exc))
                    return
                state["finished"] = int(state["finished"]) + 1  # type: ignore[call-overload]
                if workload.mode == LoopMode.CLOSED and unsent:
                    await send(unsent.popleft(), t)
                if state["finished"] == len(specs):
                    done.set()

        await nc.subscribe(f"{prefix}.*", cb=on_msg)
        if cpu is not None:
            cpu_before = cpu()
        start = time.perf_counter()
        sender: asyncio.Task[None] | None = None
        if workload.mode == LoopMode.CLOSED:
            for _ in range(min(workload.concurrency, len(unsent))):
                await send(unsent.popleft(), start)
        else:

            async def send_on_schedule() -> None:
                while unsent:
                    due = start + specs[unsent[0]].arrival_s
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await send(unsent.popleft(), due)

            sender = asyncio.ensure_future(send_on_schedule())
        await nc.flush()
        await done.wait()
        end = time.perf_counter()
        cpu_after = cpu() if cpu is not None else {}
        if sender is not None:
            sender.cancel()
        if state["failure"] is not None:
            raise BenchError(str(state["failure"]))
        record = RunRecord(start, end, [r for r in records if r is not None])
        record.cpu_before, record.cpu_after = cpu_before, cpu_after
        return record
    finally:
        await nc.close()
