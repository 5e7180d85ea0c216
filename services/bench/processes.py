"""The deployment users run, for the bench: one OS process per service (``rlt service
NAME``, as compose runs them) against a real nats-server, with ``shards`` engine shards (a
worker and a scheduler each, ``--shard 0..N-1``).

Each bench run starts a fresh set (empty schedulers, workers and prefix index), waits
until every service is ready, and stops them (SIGTERM: drain) afterwards. The processes
inherit this process's CPU affinity, so the in-process arm and this arm get the same cores.
``cpu_seconds`` reads each process's CPU time (the kernel's per-process CPU clock), so a run
can say where the CPU went.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from nats.aio.client import Client as NATS

from services.bench.metrics import own_cpu_s
from services.common.config import SchedulerConfig
from services.common.flags import dtype_name
from services.common.service_flags import service_args
from services.runtime import subjects
from services.runtime.child import service_command
from services.runtime.service import wrote_identity

# the pipeline's back end first, its public entry point last
SERVICES = ("worker", "prefix-cache", "scheduler", "admission")
# clock_getcpuclockid(3) for another process, as glibc builds it: ((~pid) << 3) | SCHED
_CPUCLOCK_SCHED = 2
_PER_SHARD = ("worker", "scheduler")


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
        shards: int = 1,
        router: str = "prefix",
        worker_device: str | None = None,
        env: dict[str, str] | None = None,
        roles: Sequence[str] = (),
    ) -> None:
        """``roles``: each shard's role (disaggregation), by shard id; empty: colocated."""
        self.roles = tuple(roles)
        self.nats_url = nats_url
        self.checkpoint = checkpoint
        self.config = config
        self.device = device
        self.worker_device = worker_device or device
        self.dtype_name = dtype_name(dtype)
        self.ready_timeout_s = max(ready_timeout_s, 30.0 * shards)
        self.shards = shards
        self.router = router
        self.env = dict(env or {})
        self._dir = tempfile.TemporaryDirectory(prefix="rlt-bench-procs-")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._names: dict[str, str] = {}  # key -> service name

    @property
    def run_dir(self) -> Path:
        return Path(self._dir.name)

    def keys(self) -> list[tuple[str, str, str | None]]:
        """(key, service, shard) of every process: ``worker`` / ``scheduler`` with one shard
        (as before), ``worker-<i>`` / ``scheduler-<i>`` with several."""
        out: list[tuple[str, str, str | None]] = []
        for name in SERVICES:
            if name in _PER_SHARD and self.shards > 1:
                out += [(f"{name}-{i}", name, str(i)) for i in range(self.shards)]
            else:
                out.append((name, name, None))
        return out

    def command(self, name: str, shard: str | None = None) -> list[str]:
        device = self.worker_device if name == "worker" else self.device
        if device == "sim" and name != "worker":
            device = "cpu"
        args = service_args(
            name,
            self.checkpoint,
            self.config,
            device=device,
            dtype=self.dtype_name,
            shard=shard,
            router=self.router,
            role=self.roles[int(shard or 0)] if self.roles else "both",
        )
        return service_command(name, self.nats_url, *args)

    def _proc_dir(self, key: str) -> Path:
        # each process its own health identity file (shards' services share names)
        path = self.run_dir / key
        path.mkdir(exist_ok=True)
        return path

    def start(self) -> None:
        base = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "RLT_LOG_LEVEL": os.environ.get("RLT_BENCH_SERVICE_LOG_LEVEL", "warning"),
            **self.env,
        }
        for key, name, shard in self.keys():  # all at once: the imports and loads overlap
            env = {**base, "RLT_RUN_DIR": str(self._proc_dir(key))}
            log = open(self.run_dir / f"{key}.log", "wb")  # noqa: SIM115 - the child's
            self.procs[key] = subprocess.Popen(
                self.command(name, shard), stdout=log, stderr=subprocess.STDOUT, env=env
            )
            self._names[key] = name
            log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        for key in self.procs:
            self._wait_ready(key, deadline)

    def _wait_ready(self, key: str, deadline: float) -> None:
        """Until the service wrote its identity file: it is registered and serving."""
        proc = self.procs[key]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"rlt service {key} exited:\n{self.log(key)[-3000:]}")
            if wrote_identity(self._names[key], self._proc_dir(key), proc.pid):
                return
            time.sleep(0.05)
        raise TimeoutError(f"rlt service {key} not ready:\n{self.log(key)[-3000:]}")

    def log(self, key: str) -> str:
        return (self.run_dir / f"{key}.log").read_text(errors="replace")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each live process has used so far, by key."""
        return {key: process_cpu_s(p.pid) for key, p in self.procs.items() if p.poll() is None}

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


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used, every thread including those that ended (0 when it
    is gone): Linux's CPU-time clock of that process, in nanoseconds (/proc/PID/stat counts
    10 ms clock ticks, coarse for a run of a few hundred ms)."""
    try:
        return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        return 0.0


def cpu_snapshot(procs: ServiceProcesses, nats_pid: int) -> dict[str, float]:
    """CPU seconds used so far by every service process, nats-server, and this process
    (``client``: the bench drives the workload from here)."""
    out = procs.cpu_seconds()
    out["nats-server"] = process_cpu_s(nats_pid)
    out["client"] = own_cpu_s()
    return out


def cmdline(pid: int) -> list[str]:
    """A process's arguments ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(x) for x in path.read_text().split()]
    except OSError:
        return []


def child_pid(pid: int, marker: str) -> int | None:
    """The child of ``pid`` with ``marker`` as an argument or as its program's name."""
    for child in child_pids(pid):
        argv = cmdline(child)
        if argv and (marker in argv or Path(argv[0]).name == marker):
            return child
    return None


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
