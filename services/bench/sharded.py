"""The sharded deployment backend: ``N`` engine shards as OS processes behind one admission
(its router), a prefix index and a real nats-server, driven by the pipeline's client.

Besides the client-side timings every backend records, a run here says where the CPU went
(admission, prefix index, nats-server, the schedulers, the workers: /proc CPU time over the
run), how many requests each shard served (the ``shard`` of each finished event), how many
steps the schedulers ran, and for ``--device sim`` workers the simulated device time. Every
metric of a simulated run carries ``simulated = 1``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import torch

from services.bench.backends import BenchError
from services.bench.metrics import Metrics, RunRecord
from services.bench.pipeline import _drive
from services.bench.processes import ServiceProcesses, cpu_snapshot
from services.bench.workloads import Workload
from services.common.config import SchedulerConfig
from services.launcher import NatsServer, free_port
from services.runtime import subjects

# the shared control plane: what must not grow per token with the number of shards
CONTROL_PLANE = ("admission", "prefix-cache", "nats-server")


@dataclass(frozen=True)
class ShardSetup:
    """How an arm deploys: shards, the router's policy, the workers' device."""

    shards: int = 1
    router: str = "prefix"
    device: str = ""  # "" = the bench's device; "sim" = the simulated device
    sim_dilation: float = 1.0  # sim only: every simulated time x this (RLT_SIM_DILATION)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def simulated(self) -> bool:
        return self.device == "sim"


class ShardedBackend:
    name = "shards"

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        run_timeout_s: float = 1800.0,
    ) -> None:
        self.checkpoint = Path(checkpoint)
        self.device = device
        self.dtype = dtype
        self.run_timeout_s = run_timeout_s
        self._server: NatsServer | None = None

    def _ensure_server(self) -> NatsServer:
        if self._server is None:
            self._server = NatsServer(host="127.0.0.1", port=free_port()).start()
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def run(self, workload: Workload, config: SchedulerConfig, setup: ShardSetup) -> RunRecord:
        server = self._ensure_server()
        env = dict(setup.env)
        if setup.simulated:
            env["RLT_SIM_DILATION"] = repr(setup.sim_dilation)
        with ServiceProcesses(
            server.url,
            self.checkpoint,
            config,
            device=self.device,
            dtype=self.dtype,
            shards=setup.shards,
            router=setup.router,
            worker_device=setup.device or None,
            env=env,
        ) as procs:
            assert server.proc is not None
            return asyncio.run(
                asyncio.wait_for(
                    self._run(server, procs, workload, setup), timeout=self.run_timeout_s
                )
            )

    async def _run(
        self, server: NatsServer, procs: ServiceProcesses, workload: Workload, setup: ShardSetup
    ) -> RunRecord:
        assert server.proc is not None
        nc = await nats.connect(server.url, connect_timeout=5)
        try:
            await _wait_healthy(nc, setup.shards)
            before = cpu_snapshot(procs, server.proc.pid)
            record = await _drive(server.url, workload)
            after = cpu_snapshot(procs, server.proc.pid)
            stats = await _shard_stats(nc, setup.shards)
        finally:
            await nc.close()
        record.extra = _extra(record, setup, before, after, stats)
        return record


async def _health(nc: Any, service: str, shard: str | None = None) -> dict[str, Any]:
    msg = await nc.request(subjects.health(service, shard), b"", timeout=10)
    return dict(json.loads(msg.data))


async def _wait_healthy(nc: Any, shards: int, timeout: float = 60.0) -> None:
    """Until admission routes to every shard (each announced, with a worker)."""
    deadline = time.monotonic() + timeout
    want = {str(i) for i in range(shards)}
    while time.monotonic() < deadline:
        try:
            seen = (await _health(nc, "admission"))["shards"]
            if want <= {sid for sid, s in seen.items() if s["healthy"]}:
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise BenchError(f"the {shards} shards did not all become healthy in {timeout:.0f}s")


async def _shard_stats(nc: Any, shards: int) -> dict[str, float]:
    batches = simulated_s = 0.0
    for i in range(shards):
        sched = await _health(nc, "scheduler", str(i))
        worker = await _health(nc, "worker", str(i))
        batches += float(sched.get("batches", 0))
        simulated_s += float(worker.get("simulated_s", 0.0))
    return {"batches": batches, "simulated_s": simulated_s}


def _component(key: str) -> str:
    for name in ("worker", "scheduler"):
        if key == name or key.startswith(f"{name}-"):
            return f"{name}s"
    return key


def _extra(
    record: RunRecord,
    setup: ShardSetup,
    before: dict[str, float],
    after: dict[str, float],
    stats: dict[str, float],
) -> Metrics:
    cpu: dict[str, float] = {}
    for key, t in after.items():
        comp = _component(key)
        cpu[comp] = cpu.get(comp, 0.0) + t - before.get(key, t)
    tokens = sum(len(r.token_times) for r in record.requests)
    per_shard = [0] * setup.shards
    for r in record.requests:
        if r.shard.isdigit() and int(r.shard) < setup.shards:
            per_shard[int(r.shard)] += 1
    mean = len(record.requests) / setup.shards
    control = sum(cpu.get(c, 0.0) for c in CONTROL_PLANE)
    batches = stats["batches"]
    sched_step = cpu.get("schedulers", 0.0) / batches if batches else None
    sim_step = stats["simulated_s"] / batches if batches and setup.simulated else None
    out: Metrics = {
        "shards": setup.shards,
        "simulated": 1 if setup.simulated else 0,
        "sim_dilation": setup.sim_dilation if setup.simulated else None,
        "shard_imbalance": max(per_shard) / mean if mean else None,
        "steps": batches,
        "control_cpu_us_per_token": control / tokens * 1e6 if tokens else None,
        "scheduler_cpu_us_per_step": sched_step * 1e6 if sched_step is not None else None,
        "sim_device_ms_per_step": sim_step * 1e3 if sim_step is not None else None,
        "scheduler_cpu_per_sim_pass": (
            sched_step / sim_step if sched_step is not None and sim_step else None
        ),
        "cpu_count": os.cpu_count(),
    }
    for comp, seconds in sorted(cpu.items()):
        slug = comp.replace("-", "_")
        out[f"cpu_s_{slug}"] = seconds
        out[f"cpu_us_per_token_{slug}"] = seconds / tokens * 1e6 if tokens else None
    return out
