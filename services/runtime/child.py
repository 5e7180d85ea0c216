"""A service run as a supervised child process of ``rlt up``.

``rlt up`` runs every service in a process of its own, as compose runs them: a worker's
pass then never holds up the scheduler's event loop, nor the bus, nor the other services
(with async scheduling, a process per service against the four in one: 1.08-1.41x the
tokens/s on this 2-core machine, 2.5x on an H200; docs/benchmarks/README.md, "Pipeline").

A child runs in its own session (a terminal's Ctrl-C reaches ``rlt up`` only, which then
stops the children one by one with SIGTERM, so each drains). It gets its NATS credentials
in its environment, never on its command line (where ``ps`` would show them), and
``RLT_PARENT_PID``: should ``rlt up`` be killed, the child notices its parent is gone and
stops (``services.runtime.service``). A child that dies is started again, with a growing
delay while it keeps failing; the services' own failover covers what it held (a lost
worker's batches are replayed, a lost scheduler's requests move).

These classes have what ``services.runtime.service.serve`` needs of a service: ``name``,
``state``, ``start`` and ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.runtime.bus import split_credentials
from services.runtime.logging import get_logger
from services.runtime.service import PARENT_PID_ENV, health_file, wrote_identity

RESTART_DELAY_S = 1.0  # doubled after each start that failed, up to RESTART_DELAY_MAX_S
RESTART_DELAY_MAX_S = 30.0
_POLL_S = 0.05  # while a child starts
# while it runs: polled, not waited for on a thread, so that any number of children leave
# the event loop's default executor free (a wait per child once exhausted it, and a stop
# then queued behind the waits for ever)
_EXIT_POLL_S = 0.2
# what services.runtime.bus.auth_options reads: a child gets its own user's and nothing of
# the shell's (which could name another user, or credentials of the caller's)
_AUTH_ENV = (
    "RLT_NATS_USER",
    "RLT_NATS_PASSWORD",
    "RLT_NATS_PASSWORD_FILE",
    "RLT_NATS_TOKEN",
    "RLT_NATS_TOKEN_FILE",
    "RLT_NATS_CREDS",
    "RLT_NATS_NKEY_SEED",
)


def service_command(name: str, nats_url: str, *args: str) -> list[str]:
    """``rlt service NAME --nats-url URL ARGS...`` run by this Python."""
    return [sys.executable, "-m", "services.cli", "service", name, "--nats-url", nats_url, *args]


class ChildProcess:
    """A supervised child process; a subclass says what it runs and when it is ready."""

    ready_timeout_s = 120.0

    def __init__(self, name: str, nats_url: str) -> None:
        self.name = name
        # credentials travel in the environment; the URL on the command line has none
        self.nats_url, creds = split_credentials(nats_url)
        self.env = {k: v for k, v in os.environ.items() if k not in _AUTH_ENV}
        if "password" in creds:
            self.env.update(RLT_NATS_USER=creds["user"], RLT_NATS_PASSWORD=creds["password"])
        elif "token" in creds:
            self.env.update(RLT_NATS_TOKEN=creds["token"])
        self.env[PARENT_PID_ENV] = str(os.getpid())
        self.state = "created"
        self.log = get_logger(name, role="supervisor")
        self.proc: subprocess.Popen[bytes] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._restarts = True  # off once rlt up is stopping (``hold``)

    # ------------------------------------------------------------------ what a subclass says
    def command(self) -> list[str]:
        raise NotImplementedError

    def pass_fds(self) -> Sequence[int]:
        return ()

    async def is_ready(self) -> bool:
        """Whether the child (``self.proc``, alive) serves."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Runnable
    def launch(self) -> None:
        """Starts the process without waiting for it: launching every child first lets
        their imports and checkpoint loads overlap; ``start`` then only waits."""
        if self.proc is None or self.proc.poll() is not None:
            self.before_spawn()
            self.proc = subprocess.Popen(
                self.command(), pass_fds=tuple(self.pass_fds()), env=self.env,
                start_new_session=True,
            )  # fmt: skip

    def hold(self) -> None:
        """No more restarts: ``rlt up`` is stopping (a child that exits meanwhile, say to a
        signal for the whole process group, stays down)."""
        self._restarts = False

    async def start(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            # launched with the others, it died before its turn: once more, then it counts
            self.log.error(f"{self.name} process exited early", exit_code=self.proc.returncode)
        self.launch()
        await self._wait_ready()
        self.state = "ready"
        self._watch = asyncio.ensure_future(self._supervise())

    async def stop(self, drain_timeout: float) -> None:
        self.state = "stopping"
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._end(drain_timeout + 15.0)
        self.state = "stopped"

    # ------------------------------------------------------------------ internals
    def before_spawn(self) -> None:
        """Hook: runs before each spawn (e.g. removing the last run's readiness marker)."""

    async def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # its own log lines above say why
                raise OSError(f"the {self.name} process exited with {self.proc.returncode}")
            if await self.is_ready():
                return
            await asyncio.sleep(_POLL_S)
        await self._end(5.0)
        raise OSError(f"the {self.name} process did not serve within {self.ready_timeout_s:.0f}s")

    async def _exited(self) -> int:
        assert self.proc is not None
        while (code := self.proc.poll()) is None:
            await asyncio.sleep(_EXIT_POLL_S)
        return code

    async def _end(self, timeout: float) -> None:
        """SIGTERM (the child drains), then SIGKILL after ``timeout``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self._exited(), timeout)
        except TimeoutError:
            proc.kill()
            await self._exited()

    @property
    def _supervised(self) -> bool:
        return self.state == "ready" and self._restarts

    async def _supervise(self) -> None:
        """Starts the child again if it dies, while we run."""
        delay = RESTART_DELAY_S
        while True:
            code = await self._exited()
            if not self._supervised:
                return
            self.log.error(f"{self.name} process exited; starting it again", exit_code=code)
            await asyncio.sleep(delay)
            if not self._supervised:  # stopped meanwhile
                return
            try:
                self.launch()
                await self._wait_ready()
                delay = RESTART_DELAY_S
            except OSError as exc:
                delay = min(2 * delay, RESTART_DELAY_MAX_S)
                self.log.error(f"{self.name} process did not start again", error=str(exc))


def end_all(children: Sequence[ChildProcess], timeout: float) -> None:
    """Without an event loop (``rlt up``'s last clean-up): SIGTERM to every child still
    running at once, SIGKILL to those still there after ``timeout`` (or on an impatient
    Ctrl-C meanwhile); each reaped."""
    running = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class ServiceProcess(ChildProcess):
    """``rlt service NAME ARGS...`` as a child; ready once it wrote its identity file (it is
    registered and serving). ``run_dir``: its own folder for that file (shards' services
    share names)."""

    ready_timeout_s = 300.0  # a worker loads its checkpoint first

    def __init__(self, name: str, nats_url: str, args: Sequence[str], run_dir: Path) -> None:
        super().__init__(name, nats_url)
        self.args = list(args)
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.env["RLT_RUN_DIR"] = str(run_dir)

    def command(self) -> list[str]:
        return service_command(self.name, self.nats_url, *self.args)

    def before_spawn(self) -> None:
        health_file(self.name, self.run_dir).unlink(missing_ok=True)  # the last incarnation's

    async def is_ready(self) -> bool:
        return self.proc is not None and wrote_identity(self.name, self.run_dir, self.proc.pid)
