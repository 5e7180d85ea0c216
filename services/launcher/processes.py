"""The services as OS processes started from outside, one ``rlt service NAME`` each (and
``rlt up`` whole), for what drives a deployment to its limits: the soak and fuzz scripts and
the reliability tests. Start, kill -9, SIGSTOP, restart, wait until ready, read RSS.

Unlike ``rlt up``'s supervised children (``services.runtime.child``) nothing here restarts a
process by itself: the caller decides what dies and when. Each process logs to its own file;
``ServiceProcs.logs(name)`` returns what it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.launcher.build import SERVICE_ORDER
from services.runtime.child import service_command
from services.runtime.service import wrote_identity

SERVICES = SERVICE_ORDER


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    run_dir: Path | None = None  # where it writes its health identity file

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class ServiceProcs:
    """Starts ``rlt service`` processes against one NATS URL with shared engine flags."""

    nats_url: str
    checkpoint: Path
    workdir: Path
    engine_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    _count: int = 0

    def start(
        self,
        name: str,
        env: dict[str, str] | None = None,
        key: str | None = None,
        *,
        shard: str | None = None,
        args: Sequence[str] = (),
    ) -> Proc:
        """Starts one service; ``key`` names it here (e.g. "worker-2"; default: the name).
        ``shard`` runs a scheduler or worker for that shard (its own health-file dir);
        ``args`` are its own extra flags (e.g. the gateway's ``--http-port``)."""
        self._count += 1
        key = key or (name if shard is None else f"{name}-{shard}")
        log_path = self.workdir / f"{key}-{self._count}.log"
        cmd = service_command(name, self.nats_url)
        if name != "prefix-cache":
            cmd += ["--checkpoint", str(self.checkpoint)]
        cmd += list(self.engine_args) + list(args)
        run_dir = self.workdir
        if shard is not None:
            cmd += ["--shard", shard]
            run_dir = self.workdir / f"run-{key}"
            run_dir.mkdir(exist_ok=True)
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RLT_RUN_DIR": str(run_dir),
            "RLT_LOG_LEVEL": os.environ.get("RLT_TEST_LOG_LEVEL", "info"),
            **self.env,
            **(env or {}),
        }
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        proc = self.procs[key] = Proc(name, popen, log_path, run_dir)
        return proc

    async def start_shards(self, n: int, *, args: Sequence[str] = ()) -> None:
        """Shards 0..n-1 (a worker and a scheduler each), the prefix cache and admission."""
        started = [self.start("prefix-cache")]
        for i in range(n):
            started += [self.start("worker", shard=str(i)), self.start("scheduler", shard=str(i))]
        started.append(self.start("admission", args=args))
        for proc in started:
            await self.wait_ready(proc, timeout=120.0)

    async def wait_ready(self, proc: Proc, timeout: float = 60.0) -> None:
        """Until the process wrote its health identity file (it is registered and ready)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{self.logs(proc)[-3000:]}")
            if wrote_identity(proc.name, proc.run_dir or self.workdir, proc.pid):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{proc.name} not ready in {timeout}s:\n{self.logs(proc)[-3000:]}")

    async def start_all(
        self, names: Sequence[str] = SERVICES, envs: dict[str, dict[str, str]] | None = None
    ) -> None:
        """``envs``: extra environment per service (e.g. its own NATS credentials)."""
        envs = envs or {}
        started = [self.start(n, env=envs.get(n)) for n in names]  # at once: imports overlap
        for proc in started:
            await self.wait_ready(proc)

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[key]
        if proc.alive():
            proc.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped one must see the SIGTERM
                proc.popen.terminate()
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def logs(self, proc_or_key: Proc | str) -> str:
        proc = self.procs[proc_or_key] if isinstance(proc_or_key, str) else proc_or_key
        return proc.log_path.read_text(errors="replace")

    def rss_kib(self, key: str) -> int:
        """Resident set size of a live service process, in KiB."""
        for line in Path(f"/proc/{self.procs[key].pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def service_procs(
    nats_url: str,
    checkpoint: Path,
    workdir: Path,
    engine_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[ServiceProcs]:
    """``ServiceProcs`` whose processes are all stopped on leaving, whatever happened."""
    procs = ServiceProcs(nats_url, checkpoint, workdir, engine_args, dict(env or {}))
    try:
        yield procs
    finally:
        procs.stop_all()


async def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    """Polls an async or plain predicate until it is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def start_rlt_up(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float = 120.0
) -> tuple[subprocess.Popen[str], str]:
    """``rlt up`` (``cmd``) and its banner, once it printed it (it is killed if it does not
    within ``timeout_s``). Its stderr, which its service processes share, goes to
    ``log_path``: a pipe nobody reads would fill and stall them all."""
    with open(log_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: [lines.put(x) for x in out], daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        banner = ""
        while "rlt is up" not in banner:
            banner = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    with contextlib.suppress(queue.Empty):  # the rest of the banner comes in the same write
        while True:
            banner += lines.get(timeout=0.5)
    return proc, banner


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
