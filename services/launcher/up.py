"""``rlt up``: an embedded nats-server (or a cluster of them), then every service in a process
of its own, as compose runs them (``--one-process`` runs the engine's four in ``rlt up``'s
own), and the HTTP gateway last. NATS requires credentials unless ``--insecure``: each
service gets its own user, and clients get the client URL from a file only this OS user can
read, which dies with the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from services.common.flags import device_from_args, torch_dtype
from services.gateway.process import GatewayProcess
from services.launcher.build import (
    GATEWAY,
    admission_config,
    build_services,
    resolve_checkpoint,
    service_processes,
)
from services.launcher.nats_servers import NatsCluster, NatsServer, is_loopback
from services.launcher.service import run_main
from services.launcher.settings import UpSettings
from services.runtime import subjects
from services.runtime.bus import default_client_url_file, split_credentials, write_secret
from services.runtime.child import ChildProcess, end_all
from services.runtime.logging import LOG_FORMAT_ENV, resolve_log_format
from services.runtime.permissions import LocalAuth
from services.runtime.service import Runnable, serve


def main_up(args: argparse.Namespace) -> int:
    settings = UpSettings.from_args(args)
    device_from_args(args)  # --no-cuda-graphs reaches the worker processes (RLT_DECODE_MODE)
    # the service processes log as this one does: their stderr is ours, but a child decides
    # nothing on its own (a pipe or file there would make it JSON under a console rlt up)
    os.environ[LOG_FORMAT_ENV] = resolve_log_format(args.log_format, sys.stderr)
    return run_up(settings)


def run_up(settings: UpSettings) -> int:
    """Runs the deployment until Ctrl-C (or SIGTERM); the exit status of ``rlt up``."""
    checkpoint = resolve_checkpoint(settings.checkpoint)
    try:
        tenants = tuple(subjects.check_tenant(t) for t in settings.tenants)
    except ValueError as exc:
        print(f"rlt up: {exc}", file=sys.stderr)
        return 2
    http = settings.http
    if not is_loopback(http.host) and not http.api_keys and not http.no_api_key:
        print(
            f"rlt up: --http-host {http.host} serves beyond this machine: give --api-key "
            "(or --api-key-file, or $RLT_API_KEY), or --no-api-key to serve without keys",
            file=sys.stderr,
        )
        return 2
    _warn_unauthenticated(settings)
    auth = None if settings.insecure else LocalAuth.generate(tenants)
    secrets_dir = Path(tempfile.mkdtemp(prefix="rlt-up-"))  # 0700
    server = _nats_server(settings, auth, secrets_dir)
    try:
        server.start()
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        print(f"rlt up: {exc}", file=sys.stderr)
        shutil.rmtree(secrets_dir, ignore_errors=True)
        return 1
    # filled as things start, so that the cleanup below undoes whatever a failure left
    children: list[ChildProcess] = []  # every child process, the gateway's too
    credential_files: list[Path] = []
    try:
        url_for = (lambda name: auth.url(name, server.url)) if auth is not None else None
        run_dir = secrets_dir / "services"
        services = _engine(settings, checkpoint, server.url, url_for, run_dir, children)
        # its own process, so HTTP work never runs on the engine's event loop
        gateway = GatewayProcess(
            url_for(GATEWAY) if url_for is not None else server.url,
            checkpoint,
            host=settings.http.host,
            port=settings.http.port,
            served_model_name=settings.http.served_model_name,
            api_keys=settings.http.api_keys,
            metrics_api_keys=settings.http.metrics_api_keys,
        )
        services.append(gateway)
        children.append(gateway)
        client_files: dict[str, Path] | None = None
        if auth is not None:
            client_files = _write_client_urls(settings.client_url_file, auth, server.url, tenants)
            credential_files += client_files.values()
            operator_file = settings.operator_url_file
            if operator_file is not None:  # everything: for `nats micro ls` and debugging
                write_secret(operator_file, auth.url("operator", server.url) + "\n")
                credential_files.append(operator_file)

        def banner() -> str:  # once ready: the gateway's port and model name are known then
            http_url = f"http://{_url_host(settings.http.host)}:{gateway.port}"
            return _banner(
                server.url,
                checkpoint,
                client_files,
                http_url,
                gateway.model_name,
                settings.shards,
                settings.router,
                keyed=bool(settings.http.api_keys),
            )

        return run_main("rlt up", _serve(services, children, banner))
    finally:
        try:
            # those serve never started or stopped (a start failed, or an impatient Ctrl-C)
            end_all(children, 15.0)
        finally:
            server.stop()
            for path in credential_files:
                _remove_if_ours(path, server.url)  # the credentials die with this run
            shutil.rmtree(secrets_dir, ignore_errors=True)


def _engine(
    settings: UpSettings,
    checkpoint: Path,
    url: str,
    url_for: Callable[[str], str] | None,
    run_dir: Path,
    children: list[ChildProcess],
) -> list[Runnable]:
    """The engine's services, a worker and a scheduler per shard: built in this process
    (``--one-process``), else launched as child processes, each added to ``children`` as
    it is made so that the caller's clean-up ends it whatever fails next."""
    if settings.one_process:
        return list(
            build_services(
                url,
                checkpoint,
                settings.config,
                admission_config(settings.router),
                device=settings.device,
                dtype=torch_dtype(settings.dtype),
                shards=settings.shards,
                url_for=url_for,
                roles=settings.roles,
            )
        )
    processes = service_processes(
        url,
        checkpoint,
        settings.config,
        run_dir,
        device=settings.device,
        dtype=settings.dtype,
        shards=settings.shards,
        router=settings.router,
        url_for=url_for,
        roles=settings.roles,
    )
    children += processes
    for child in processes:
        child.launch()  # all at once: their imports and checkpoint loads overlap
    return list(processes)


def _warn_unauthenticated(settings: UpSettings) -> None:
    if settings.insecure:
        host = settings.host
        reach = "every local process" if is_loopback(host) else f"anyone who can reach {host}"
        print(
            f"rlt up: warning: --insecure: NATS has no authentication; {reach} can submit "
            "requests, read every stream and publish into the services' internal subjects",
            file=sys.stderr,
        )
    if not is_loopback(settings.http.host) and not settings.http.api_keys:
        print(
            f"rlt up: warning: --no-api-key: the HTTP gateway listens on {settings.http.host} "
            "without authentication; put an authenticating proxy in front of it",
            file=sys.stderr,
        )


def _nats_server(
    settings: UpSettings, auth: LocalAuth | None, secrets_dir: Path
) -> NatsServer | NatsCluster:
    """The nats-server(s) to run (not started), with ``auth``'s users in their config."""
    nodes = settings.nats_nodes
    conf = secrets_dir / "nats.conf"
    if auth is not None:
        write_secret(conf, auth.config(cluster=nodes > 1))
    config_file = conf if auth is not None else None
    if nodes > 1:
        # real routes between real nats-server processes; JetStream replicates the event
        # stream over them (R3 with three nodes), so losing one node loses nothing
        ports = [settings.port + i for i in range(nodes)]
        return NatsCluster(
            nodes,
            settings.host,
            ports,
            config_file=config_file,
            route_auth=auth.route if auth is not None else None,
        )
    return NatsServer(settings.host, settings.port, config_file=config_file)


async def _serve(
    services: Sequence[Runnable], children: Sequence[ChildProcess], banner: Callable[[], str]
) -> None:
    """``serve`` the services, printing the banner once every one is ready."""
    stopping = asyncio.Event()
    task = asyncio.ensure_future(serve(services, stop=stopping))
    hold = asyncio.ensure_future(_hold_on_stop(stopping, children))
    while not task.done() and not all(s.state == "ready" for s in services):
        await asyncio.sleep(0.05)
    if not task.done():  # (serve failed otherwise: its error is the story, not a banner)
        print(banner(), flush=True)
    try:
        await task
    finally:
        hold.cancel()


async def _hold_on_stop(stopping: asyncio.Event, children: Sequence[ChildProcess]) -> None:
    """Once ``rlt up`` stops, no child is restarted: ``serve`` stops them one at a time,
    and one that exits meanwhile (a signal to the whole group) stays down."""
    await stopping.wait()
    for child in children:
        child.hold()


def _write_client_urls(
    given: Path | None, auth: LocalAuth, url: str, tenants: Sequence[str]
) -> dict[str, Path]:
    """The client URL (client credentials in it) for each tenant, readable by this OS user
    only: only clients get client credentials, and no client gets a service's. ``given``:
    the default tenant's file (default: ``default_client_url_file()``); a tenant's is that
    name + ``.TENANT``."""
    base = given if given is not None else default_client_url_file()
    written: dict[str, Path] = {}
    for tenant in (subjects.DEFAULT_TENANT, *tenants):
        path = base if not tenant else base.with_name(f"{base.name}.{tenant}")
        user = "client" if not tenant else f"tenant-{tenant}"
        write_secret(path, auth.url(user, url) + "\n")
        written[tenant] = path
    return written


def _remove_if_ours(path: Path, url: str) -> None:
    """Removes a URL file this run wrote, unless another ``rlt up`` has replaced it since."""
    try:
        if split_credentials(path.read_text().strip())[0] == url:
            path.unlink()
    except OSError:
        pass


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


def _rlt_command() -> str:
    """The ``rlt`` that is running, as a command a shell finds: its full path unless the
    first ``rlt`` on PATH is this one (a virtualenv's rlt is often not on PATH)."""
    argv0 = Path(sys.argv[0])
    if argv0.name != "rlt":
        return f"{shlex.quote(sys.executable)} -m services.cli"
    on_path = shutil.which("rlt")
    if on_path is not None and Path(on_path).resolve() == argv0.resolve():
        return "rlt"
    return shlex.quote(str(argv0.resolve()))


def _banner(
    url: str,
    checkpoint: Path,
    client_files: dict[str, Path] | None,
    http_url: str,
    model: str,
    shards: int = 1,
    router: str = "prefix",
    keyed: bool = False,
) -> str:
    payload = '{"prompt":"hello","max_tokens":8}'
    nodes = len(url.split(","))
    what = f"JetStream, a {nodes}-node cluster" if nodes > 1 else "JetStream"
    layout = "" if shards == 1 else f"   {shards} shards (ids 0..{shards - 1}), router {router}"
    if keyed:
        key_expr = '__import__("os").environ["RLT_API_KEY"]'
        key_header = ' -H "Authorization: Bearer $RLT_API_KEY"'
        key_note = "the API needs one of the keys rlt up was given (here: in $RLT_API_KEY)"
    else:
        key_expr, key_header = '"-"', ""
        key_note = "no API key: the gateway answers anyone who can reach its address"
    rlt = _rlt_command()
    head = f"""\
rlt is up: NATS {url} ({what}), HTTP {http_url}, checkpoint {checkpoint}
services: worker, prefix-cache, scheduler, admission, gateway{layout}   (Ctrl-C stops everything)

  with the OpenAI client (pip install openai):
    python -c 'from openai import OpenAI
c = OpenAI(base_url="{http_url}/v1", api_key={key_expr})
print(c.completions.create(model="{model}", prompt="hello", max_tokens=8).choices[0].text)'
  with curl (server-sent events as tokens are made):
    curl -N {http_url}/v1/completions -H "Content-Type: application/json"{key_header} \\
      -d '{{"model":"{model}","prompt":"hello","max_tokens":8,"stream":true}}'
  {key_note}
"""
    if client_files is None:
        return (
            head
            + f"""
  NO AUTHENTICATION (--insecure): every local process can read every stream.
    nats -s {url} req --replies 0 --timeout 5s rlt.v1.generate '{payload}'
    {rlt} generate --nats-url {url} --max-tokens 8 "hello"
"""
        )
    path = client_files[""]
    default = default_client_url_file()
    reads = "it reads that file by itself" if path == default else "told where the file is"
    env = "" if path == default else f"RLT_CLIENT_URL_FILE={shlex.quote(str(path.resolve()))} "
    tenants = "".join(f"\n    tenant {t}: {p}" for t, p in client_files.items() if t)
    return (
        head
        + f"""
  NATS requires credentials: each service has its own user, and the client URL (with the
  client credentials, readable by you only) is in {path}{tenants}
  with the rlt client ({reads}):
    {env}{rlt} generate --max-tokens 8 "hello"
  with the nats CLI (--replies 0 keeps reading the whole stream):
    nats -s "$(cat {path})" req --replies 0 --timeout 5s rlt.v1.generate '{payload}'
  with Python (nats-py): services.client.stream_requests(None, ...) reads it too
"""
    )
