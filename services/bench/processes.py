"""The deployment users run, for the bench: one OS process per service (``rlt service
NAME``, as compose runs them) against a real nats-server.

Each bench run starts a fresh set (an empty scheduler, worker and prefix index), waits
until every service is ready, and stops them (SIGTERM: drain) afterwards. The processes
inherit this process's CPU affinity, so the in-process arm and this arm get the same cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from nats.aio.client import Client as NATS

from services.common.config import SchedulerConfig
from services.common.flags import DTYPES, engine_args
from services.runtime import subjects

# the pipeline's back end first, its public entry point last
SERVICES = ("worker", "prefix-cache", "scheduler", "admission")


class ServiceProcesses:
    def __init__(
        self,
        nats_url: str,
        checkpoint: Path,
        config: SchedulerConfig,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.nats_url = nats_url
        self.checkpoint = checkpoint
        self.config = config
        self.device = device
        self.dtype_name = next(name for name, d in DTYPES.items() if d == dtype)
        self.ready_timeout_s = ready_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="rlt-bench-procs-")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def run_dir(self) -> Path:
        return Path(self._dir.name)

    def command(self, name: str) -> list[str]:
        cmd = [sys.executable, "-m", "services.cli", "service", name, "--nats-url", self.nats_url]
        if name != "prefix-cache":
            cmd += ["--checkpoint", str(self.checkpoint)]
        cmd += engine_args(self.config)
        cmd += ["--device", self.device, "--dtype", self.dtype_name]
        return cmd

    def start(self) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "RLT_RUN_DIR": str(self.run_dir),  # each service's health identity file
            "RLT_LOG_LEVEL": os.environ.get("RLT_BENCH_SERVICE_LOG_LEVEL", "warning"),
        }
        for name in SERVICES:  # all at once: the imports and model loads overlap
            log = open(self.run_dir / f"{name}.log", "wb")  # noqa: SIM115 - the child's
            self.procs[name] = subprocess.Popen(
                self.command(name), stdout=log, stderr=subprocess.STDOUT, env=env
            )
            log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        for name in SERVICES:
            self._wait_ready(name, deadline)

    def _wait_ready(self, name: str, deadline: float) -> None:
        """Until the service wrote its identity file: it is registered and serving."""
        proc = self.procs[name]
        path = self.run_dir / f"rlt-{name}.json"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"rlt service {name} exited:\n{self.log(name)[-3000:]}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                if json.loads(path.read_text())["pid"] == proc.pid:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"rlt service {name} not ready:\n{self.log(name)[-3000:]}")

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self._dir.cleanup()

    def __enter__(self) -> ServiceProcesses:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def worker_runner_stats(nc: NATS, timeout: float = 5.0) -> dict[str, float]:
    """The worker's ``RunnerStats`` (batches, passes, rows, time executing), from its
    health reply: what the bench's in-process probe counts, for a worker in a process."""
    msg = await nc.request(subjects.health("worker"), b"", timeout=timeout)
    return dict(json.loads(msg.data).get("runner", {}))


async def step_timings(nc: NATS, timeout: float = 5.0) -> dict[str, float]:
    """The scheduler's ``StepTimings`` plus the worker's decode time, summed since start."""
    sched = await nc.request(subjects.health("scheduler"), b"", timeout=timeout)
    worker = await nc.request(subjects.health("worker"), b"", timeout=timeout)
    timings = dict(json.loads(sched.data).get("timings", {}))
    timings["decode_s"] = float(json.loads(worker.data).get("decode_s", 0.0))
    return timings
