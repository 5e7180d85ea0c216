"""The gateway as a child process of ``rlt up``.

``rlt up`` runs the engine's services in one process, but not the gateway: HTTP parsing,
SSE framing and the per-token NATS traffic of every open stream would share that process's
event loop and GIL with the scheduler and the worker, and every microsecond the gateway
spends per token would come off the engine's step (measured in
docs/benchmarks/gateway.md). So, like vLLM's API server beside its engine core, the
gateway gets a process of its own, which the operating system can put on another core.

``rlt up`` binds the HTTP socket itself (a port in use fails the start at once, with a
clear message) and hands the listening socket to ``rlt service gateway --http-fd N``. The
child gets the gateway's NATS credentials in its environment, never on its command line
(where ``ps`` would show them). It runs in its own session: ``rlt up`` stops it (SIGTERM:
it drains like any service) before the engine's services, and starts it again should it
die. Should ``rlt up`` itself be killed, the child notices that its parent is gone and
stops (``GatewayService``, in this mode only). Its log lines go to the same stderr as the
rest of ``rlt up``.

``GatewayProcess`` has what ``services.runtime.service.serve`` needs of a service:
``name``, ``state``, ``start`` and ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from services.runtime.bus import split_credentials
from services.runtime.logging import get_logger

READY_TIMEOUT_S = 120.0  # the child imports torch and reads the checkpoint's config
RESTART_DELAY_S = 1.0  # doubled after each start that failed, up to RESTART_DELAY_MAX_S
RESTART_DELAY_MAX_S = 30.0


def model_name_for(checkpoint: str | Path, served_model_name: str | None) -> str:
    """The model's name in the API: ``--served-model-name``, else the checkpoint's name."""
    return served_model_name or Path(checkpoint).resolve().name


def bind_http(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket for the HTTP server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"the gateway cannot listen on {host}:{port}: {exc.strerror}"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class GatewayProcess:
    name = "gateway"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: str | None = None,
    ) -> None:
        # credentials travel in the environment; the URL on the command line has none
        self.nats_url, creds = split_credentials(nats_url)
        self._env = dict(os.environ)
        if "password" in creds:
            self._env.update(RLT_NATS_USER=creds["user"], RLT_NATS_PASSWORD=creds["password"])
        elif "token" in creds:
            self._env.update(RLT_NATS_TOKEN=creds["token"])
        self.checkpoint = Path(checkpoint)
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.model_name = model_name_for(checkpoint, served_model_name)
        self.state = "created"
        self.log = get_logger(self.name, role="supervisor")
        self.proc: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._socket = bind_http(self.host, self.port)
        self.port = self._socket.getsockname()[1]
        await self._spawn()
        self.state = "ready"
        self._watch = asyncio.ensure_future(self._supervise())

    async def stop(self, drain_timeout: float) -> None:
        self.state = "stopping"
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.to_thread(self._terminate, drain_timeout + 15.0)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self.state = "stopped"

    # ------------------------------------------------------------------ internals
    def command(self, fd: int) -> list[str]:
        cmd = [sys.executable, "-m", "services.cli", "service", "gateway"]
        cmd += ["--nats-url", self.nats_url, "--checkpoint", str(self.checkpoint)]
        cmd += ["--http-host", self.host, "--http-port", str(self.port), "--http-fd", str(fd)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd

    async def _spawn(self) -> None:
        assert self._socket is not None
        fd = self._socket.fileno()
        self.proc = subprocess.Popen(
            self.command(fd),
            pass_fds=(fd,),
            env=self._env,
            start_new_session=True,  # a terminal's Ctrl-C reaches rlt up, which stops us
        )
        await self._wait_serving()

    async def _wait_serving(self) -> None:
        """Until the child answers HTTP on the socket (connections wait in its backlog
        meanwhile), or fails."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # its own log lines above say why
                raise OSError(f"the gateway process exited with {self.proc.returncode}")
            if await _answers_http(self.host, self.port):
                return
            await asyncio.sleep(0.05)
        self._terminate(5.0)
        raise OSError(f"the gateway process did not serve within {READY_TIMEOUT_S:.0f}s")

    async def _supervise(self) -> None:
        """Starts the gateway again if it dies: the engine keeps running, and only the HTTP
        streams open in the dead process are lost (their requests run to their end)."""
        delay = RESTART_DELAY_S
        while True:
            assert self.proc is not None
            code = await asyncio.to_thread(self.proc.wait)
            if self.state != "ready":
                return
            self.log.error("gateway process exited; starting it again", exit_code=code)
            await asyncio.sleep(delay)
            try:
                await self._spawn()
                delay = RESTART_DELAY_S
            except OSError as exc:
                delay = min(2 * delay, RESTART_DELAY_MAX_S)
                self.log.error("gateway process did not start again", error=str(exc))

    def _terminate(self, timeout: float) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _answers_http(host: str, port: int) -> bool:
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(probe, port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\nConnection: close\r\n\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 1.0)
        return status.startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
