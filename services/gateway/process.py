"""The gateway as a child process of ``rlt up``.

The gateway gets a process of its own, like every service (``services.runtime.child``)
and also when ``rlt up --one-process`` runs the engine's four in one: HTTP parsing, SSE
framing and the per-token NATS traffic of every open stream would otherwise share an event
loop and GIL with the engine, and every microsecond the gateway spends per token would come
off the engine's step (measured in docs/benchmarks/gateway.md). So, like vLLM's API server
beside its engine core, it runs where the operating system can put it on another core.

``rlt up`` binds the HTTP socket itself (a port in use fails the start at once, with a
clear message) and hands the listening socket to ``rlt service gateway --http-fd N``; the
child is ready once it answers HTTP on it. ``ChildProcess`` does the rest: credentials in
the environment, its own session, stopped with SIGTERM (it drains like any service),
started again should it die, and gone should ``rlt up`` be killed. The API keys travel in
the environment too (``$RLT_API_KEY``, one a line, which ``rlt service gateway`` reads when
no key flag is given), never on the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from pathlib import Path

from services.common.service_flags import API_KEY_ENV, METRICS_API_KEY_ENV
from services.runtime.child import ChildProcess, service_command


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


class GatewayProcess(ChildProcess):
    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: str | None = None,
        api_keys: Sequence[str] = (),
        metrics_api_keys: Sequence[str] = (),
    ) -> None:
        super().__init__("gateway", nats_url)
        self.checkpoint = Path(checkpoint)
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.model_name = model_name_for(checkpoint, served_model_name)
        self._socket: socket.socket | None = None
        # exactly these keys, whatever the shell's environment holds
        for name, keys in ((API_KEY_ENV, api_keys), (METRICS_API_KEY_ENV, metrics_api_keys)):
            self.env.pop(name, None)
            if keys:
                self.env[name] = "\n".join(keys)
        self._probe_key = api_keys[0] if api_keys else None

    async def start(self) -> None:
        self._socket = bind_http(self.host, self.port)
        self.port = self._socket.getsockname()[1]
        await super().start()

    async def stop(self, drain_timeout: float) -> None:
        await super().stop(drain_timeout)
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def command(self) -> list[str]:
        assert self._socket is not None
        cmd = service_command(self.name, self.nats_url, "--checkpoint", str(self.checkpoint))
        cmd += ["--http-host", self.host, "--http-port", str(self.port)]
        cmd += ["--http-fd", str(self._socket.fileno())]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd

    def pass_fds(self) -> Sequence[int]:
        assert self._socket is not None
        return (self._socket.fileno(),)

    async def is_ready(self) -> bool:
        """It answers HTTP on the socket (connections wait in its backlog meanwhile)."""
        return await _answers_http(self.host, self.port, self._probe_key)


async def _answers_http(host: str, port: int, api_key: str | None = None) -> bool:
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(probe, port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        writer.write(
            b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\n" + auth + b"Connection: close\r\n\r\n"
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 1.0)
        return status.startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
