"""The services as real OS processes (``rlt service NAME``), for the reliability tests and the
soak / fuzz scripts: start, kill -9, SIGSTOP, restart, read health and RSS.

Each process logs to its own file; ``ServiceProcs.logs(name)`` returns what it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from services.runtime import subjects
from services.runtime.bus import encode_json, is_no_responders

Event = TokenEvent | FinishedEvent | ErrorEvent
_DECODER = msgspec.json.Decoder(Event)
SERVICES = ("worker", "prefix-cache", "scheduler", "admission")


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
        cmd = [sys.executable, "-m", "services.cli", "service", name, "--nats-url", self.nats_url]
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
        path = (proc.run_dir or self.workdir) / f"rlt-{proc.name}.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{self.logs(proc)[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                if json.loads(path.read_text())["pid"] == proc.pid:
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
    procs = ServiceProcs(nats_url, checkpoint, workdir, engine_args, dict(env or {}))
    try:
        yield procs
    finally:
        procs.stop_all()


async def health(nc: NATS, name: str, timeout: float = 5.0) -> dict[str, Any]:
    msg = await nc.request(subjects.health(name), b"", timeout=timeout)
    return json.loads(msg.data)


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


class StreamCollector:
    """Many streams on one connection: every event of every request, by request index.

    Counts terminal events per stream so a test can assert "exactly one" after the fact."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.events: dict[int, list[Event]] = {}
        self.raw_errors: list[bytes] = []
        self.no_responders: set[int] = set()
        self._changed = asyncio.Event()

    async def start(self) -> StreamCollector:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_msg)
        return self

    def reply(self, index: int) -> str:
        return f"{self.prefix}.{index}"

    async def send(self, index: int, payload: bytes | Any, subject: str = "") -> None:
        data = payload if isinstance(payload, bytes) else encode_json(payload)
        self.events.setdefault(index, [])
        await self.nc.publish(subject or subjects.GENERATE, data, reply=self.reply(index))

    async def _on_msg(self, msg: Msg) -> None:
        index = int(msg.subject.rsplit(".", 1)[1])
        if is_no_responders(msg):
            self.no_responders.add(index)
        else:
            try:
                self.events.setdefault(index, []).append(_DECODER.decode(msg.data))
            except msgspec.DecodeError:
                self.raw_errors.append(msg.data)
        self._changed.set()

    def terminals(self, index: int) -> list[FinishedEvent | ErrorEvent]:
        return [e for e in self.events.get(index, []) if not isinstance(e, TokenEvent)]

    def done(self, indices: Sequence[int]) -> bool:
        return all(self.terminals(i) for i in indices)

    def tokens(self, index: int) -> list[TokenEvent]:
        return [e for e in self.events.get(index, []) if isinstance(e, TokenEvent)]

    async def wait_done(self, indices: Sequence[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done(indices):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i in indices if not self.terminals(i)]
                raise TimeoutError(f"no terminal event for {len(missing)} streams: {missing[:20]}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.5))


@contextlib.asynccontextmanager
async def client(url: str, **kwargs: Any) -> AsyncIterator[NATS]:
    """A test client that reconnects quickly (it must ride out NATS restarts)."""

    async def quiet(_exc: Exception) -> None:  # reconnect attempts are expected here
        return None

    options: dict[str, Any] = {
        "error_cb": quiet,
        "reconnect_time_wait": 0.2,
        "max_reconnect_attempts": -1,
        "connect_timeout": 5,
        **kwargs,
    }
    nc = await nats.connect(url, **options)
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def start_rlt_up(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float = 120.0
) -> tuple[subprocess.Popen[str], str]:
    """``rlt up`` (``cmd``) and its banner's first line, once it printed it (it is killed if
    it does not within ``timeout_s``). Its stderr, which its service processes share, goes
    to ``log_path``: a pipe nobody reads would fill and stall them all."""
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
    return proc, banner


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
