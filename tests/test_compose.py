"""compose.yaml, the Dockerfile and deploy/ agree with the CLI and the runtime, and the
compose stack serves (no Docker needed).

The static tests parse compose.yaml with the real CLI parser. ``test_compose_stack_serves``
runs compose's own commands locally: the ``init`` service's command into a temp dir standing
for the ``secrets`` volume, the three NATS nodes' entrypoint and command (a real nats-server
cluster), then every default-profile rlt service's exact command line and environment as a
process, each "container" seeing its mounts through a path map and its peers through a port
map, in the order compose's ``depends_on`` and healthchecks give; then a request through the
gateway with the API key and one through NATS with the client's credentials.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from services.cli import build_parser
from services.launcher import find_nats_server, free_port
from services.runtime import subjects
from services.runtime.health import main as health_main
from services.runtime.permissions import all_user_names, password_var
from services.runtime.service import health_file

ROOT = Path(__file__).resolve().parents[1]
RLT_SERVICES = set(subjects.SERVICE_NAMES)  # ... and gateway
NATS_NODES = ["nats-1", "nats-2", "nats-3"]
NATS_URLS = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
SHARDS = {"0": ("worker", "scheduler"), "1": ("worker-1", "scheduler-1")}
GPU_SHARD = ("worker-gpu", "scheduler-gpu")
SECRETS = "/secrets"  # where every service sees its folder of the `secrets` volume


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _rlt_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every service that runs `rlt service NAME`, by compose key."""
    return {
        key: svc
        for key, svc in compose["services"].items()
        if svc.get("command", [None])[:2] == ["rlt", "service"]
    }


def _volume(mount: str | dict[str, Any]) -> tuple[str, str, str | None, bool]:
    """(source, target, subpath, read_only) of a short or long volume entry."""
    if isinstance(mount, dict):
        subpath = (mount.get("volume") or {}).get("subpath")
        return mount["source"], mount["target"], subpath, bool(mount.get("read_only"))
    source, target, *mode = str(mount).split(":")
    return source, target, None, mode == ["ro"]


def _interpolate(value: str) -> str:
    """Compose's ``${NAME:-default}`` as ``docker compose`` fills it from an environment
    that sets no RLT_ variable (the test's containers see none of this shell's)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: m.group(2) or "", value)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.unit
def test_services_and_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert RLT_SERVICES | set(NATS_NODES) | {"init", "checkpoint-init"} <= set(services)
    assert {"checkpoints", "secrets"} <= set(compose["volumes"])
    for key, svc in _rlt_services(compose).items():
        mounts = {_volume(m)[1]: _volume(m) for m in svc["volumes"]}
        assert mounts["/data"][0] == "checkpoints", key
        # its own folder of the secrets volume only, read-only: the folder of its NATS user
        user = svc["environment"]["RLT_NATS_USER"]
        assert mounts[SECRETS] == ("secrets", SECRETS, user, True), key
        assert svc["environment"]["RLT_NATS_PASSWORD_FILE"] == f"{SECRETS}/nats_password"


@pytest.mark.unit
def test_commands_parse_with_the_cli(compose: dict[str, Any]) -> None:
    parser = build_parser()
    for key, svc in _rlt_services(compose).items():
        command = svc["command"]
        args = parser.parse_args(command[1:])
        assert args.command == "service", key
        assert args.name == svc["environment"]["RLT_NATS_USER"], key  # its own NATS user
        assert args.nats_url == NATS_URLS  # every node: a lost one fails over
        assert svc["environment"]["RLT_NATS_URL"] == NATS_URLS
        if args.name != "prefix-cache":
            # everyone reads the checkpoint the init step writes into the shared volume
            assert args.checkpoint == "/data/toy-checkpoint"
    gateway = parser.parse_args(compose["services"]["gateway"]["command"][1:])
    assert gateway.api_key_file == f"{SECRETS}/api_key"  # the gateway's folder of the volume
    init = compose["services"]["checkpoint-init"]
    script = " ".join(init["command"])
    assert "rlt toy-checkpoint /data/toy-checkpoint" in script
    assert parser.parse_args(["toy-checkpoint", "/data/toy-checkpoint"]).dir


@pytest.mark.unit
def test_init_writes_the_secrets_before_anything_starts(compose: dict[str, Any]) -> None:
    """`init` is a one-shot with the whole volume; every NATS node waits for it to have
    completed, and every rlt service for healthy NATS nodes (so for init too)."""
    services = compose["services"]
    init = services["init"]
    assert init["restart"] == "no" and "depends_on" not in init
    assert init["command"][:2] == ["sh", "/deploy/secrets-init.sh"]
    mounts = {_volume(m)[1]: _volume(m) for m in init["volumes"]}
    assert mounts[SECRETS] == ("secrets", SECRETS, None, False)
    for node in NATS_NODES:
        assert services[node]["depends_on"]["init"]["condition"] == (
            "service_completed_successfully"
        )


@pytest.mark.unit
def test_no_secret_in_the_compose_file_the_image_or_env() -> None:
    """Passwords and keys only ever come from files in the secrets volume: compose
    interpolates nothing but public settings (token-sparse prefill's, the torch index),
    sets no secret-looking variable but *_FILE ones, and the image copies no deploy file
    and no .env."""
    text = (ROOT / "compose.yaml").read_text()
    public = ["RLT_SPARSE_PREFILL", "RLT_PREFILL_RETENTION", "RLT_SPARSE_WINDOW", "RLT_TORCH_INDEX"]
    assert re.findall(r"\$\{(\w+)", text) == public
    compose = yaml.safe_load(text)
    for key, svc in compose["services"].items():
        env = svc.get("environment") or {}
        for name in env:
            secretish = any(w in name for w in ("PASSWORD", "TOKEN", "API_KEY", "SECRET"))
            assert not secretish or name.endswith("_FILE") or name == "RLT_SECRETS_DIR", (
                key,
                name,
            )
        assert not any(part == "--api-key" for part in svc.get("command", [])), key
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert not any(c.startswith(("deploy", ".env", ".")) for c in copied), copied


@pytest.mark.unit
def test_depends_on_and_healthchecks(
    compose: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLT_RUN_DIR", str(tmp_path))  # no service identity files here
    services = compose["services"]
    for node in NATS_NODES:
        nats = services[node]
        assert any("8222" in str(p) for p in nats["ports"])
        assert "--jetstream" in nats["command"] or "-js" in nats["command"]
        assert any("/healthz" in str(part) for part in nats["healthcheck"]["test"])
    for key, svc in _rlt_services(compose).items():
        name = svc["command"][2]
        for node in NATS_NODES:
            assert svc["depends_on"][node]["condition"] == "service_healthy", (key, node)
        if name != "prefix-cache":
            cond = svc["depends_on"]["checkpoint-init"]["condition"]
            assert cond == "service_completed_successfully"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        # the check module exists and takes exactly these arguments (the service's own name)
        assert test[1:4] == ["python", "-m", "services.runtime.health"]
        assert test[4] == name, key
        assert test[5:] == ["--nats-url", NATS_URLS]
    test = services["admission"]["healthcheck"]["test"]
    assert health_main([*test[4:], "--timeout", "0.1"]) == 1  # nothing runs here
    assert services["admission"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


@pytest.mark.unit
def test_shards_and_the_gpu_profile(compose: dict[str, Any]) -> None:
    """Shard 0 (worker, scheduler) and shard 1 (worker-1, scheduler-1) by default, admission
    waiting for both schedulers; the `gpu` profile adds shard "gpu": its worker on CUDA with
    an NVIDIA device reservation, from an image built with a CUDA torch index."""
    parser = build_parser()
    services = compose["services"]
    for shard, keys in {**SHARDS, "gpu": GPU_SHARD}.items():
        for key in keys:
            args = parser.parse_args(services[key]["command"][1:])
            assert args.shard == shard, key
    for key in (*SHARDS["0"], *SHARDS["1"]):
        assert "profiles" not in services[key], key  # `docker compose up` starts them
    depends = services["admission"]["depends_on"]
    assert {"scheduler", "scheduler-1"} <= set(depends) and not set(GPU_SHARD) & set(depends)
    assert parser.parse_args(services["admission"]["command"][1:]).router == "prefix"

    worker, scheduler = (services[k] for k in GPU_SHARD)
    assert worker["profiles"] == scheduler["profiles"] == ["gpu"]
    assert parser.parse_args(worker["command"][1:]).device == "cuda"
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    index = worker["build"]["args"]["TORCH_INDEX"]
    assert re.fullmatch(r"\$\{RLT_TORCH_INDEX:-cu\d+\}", index), index
    assert worker["image"] != services["worker"]["image"]  # CUDA torch: an image of its own
    assert scheduler["depends_on"]["worker-gpu"]["condition"] == "service_healthy"


@pytest.mark.unit
def test_dockerfile_builds_one_image_for_all_services() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert "ARG TORCH_INDEX=cpu" in text  # CPU torch unless the gpu profile asks
    assert text.count("download.pytorch.org/whl/${TORCH_INDEX}") == 2
    for folder in ("services", "messages", "kernels"):
        assert f"COPY {folder}" in text
    # the volumes' mount points belong to the image's user: the init services write there
    assert "chown rlt /data /secrets" in text


@pytest.mark.unit
def test_three_nats_nodes_form_one_jetstream_cluster(compose: dict[str, Any]) -> None:
    """Three nats-server nodes, one cluster name, a server name and a store volume of its
    own each (JetStream clustering needs all of these), each client port on its own loopback
    port, so `rlt generate` can be given all three. Listen address and routes are in
    deploy/nats-cluster.conf: the --cluster flag would drop the config's route authorization,
    and route URLs carry credentials (the entrypoint puts them in from the secrets volume)."""
    services = compose["services"]
    commands = {node: services[node]["command"] for node in NATS_NODES}
    assert {_flag(c, "--server_name") for c in commands.values()} == set(NATS_NODES)
    assert {_flag(c, "--cluster_name") for c in commands.values()} == {"rlt"}
    for node, command in commands.items():
        assert command[0] == "nats-server"
        assert not {"--cluster", "--cluster_listen", "--routes"} & set(command), node
        assert _flag(command, "--config") == "/deploy/nats-cluster.conf"
        assert services[node]["entrypoint"] == ["/bin/sh", "/deploy/nats-entrypoint.sh"]
        env = services[node]["environment"]
        assert env["RLT_NATS_ROUTES"].split(",") == [f"{n}:6222" for n in NATS_NODES]
        assert env["RLT_NATS_CLUSTER_LISTEN"] == "0.0.0.0:6222"
        mounts = {_volume(m)[1]: _volume(m) for m in services[node]["volumes"]}
        assert mounts["/deploy"] == ("./deploy", "/deploy", None, True)
        assert mounts[env["RLT_SECRETS_DIR"]] == ("secrets", SECRETS, None, True)
    conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    assert 'include "nats.conf"' in conf  # users and permissions on every node
    for var in ("RLT_NATS_CLUSTER_LISTEN", "RLT_NATS_ROUTE_PASSWORD", "RLT_NATS_ROUTE_URLS"):
        assert f"${var}" in conf
    stores = [
        next(_volume(v)[0] for v in services[n]["volumes"] if _volume(v)[1] == "/jetstream")
        for n in NATS_NODES
    ]
    assert len(set(stores)) == 3 and set(stores) <= set(compose["volumes"])
    published = [p for n in NATS_NODES for p in services[n]["ports"]]
    assert all(str(p).startswith("127.0.0.1:") for p in published)
    assert len({str(p).split(":")[1] for p in published}) == len(published)  # no clash


@pytest.mark.unit
def test_init_writes_every_secret_once(compose: dict[str, Any], tmp_path: Path) -> None:
    """The init command, run here: a random [A-Za-z0-9] password (mode 600) for every user
    deploy/nats.conf names and for the routes, and the API key; a second run keeps them.
    It prints where the client's secrets are, never a secret."""
    volume = tmp_path / "secrets"
    init = Container.of(compose, "init", tmp_path, Network())
    first = init.run_to_end()
    written = {p.relative_to(volume).as_posix(): p.read_text() for p in volume.rglob("*")
               if p.is_file()}  # fmt: skip
    users = {*all_user_names(()), "route"}
    assert set(written) == {f"{u}/nats_password" for u in users} | {"gateway/api_key"}
    assert all(re.fullmatch(r"[A-Za-z0-9]{32}", s) for s in written.values())
    assert len(set(written.values())) == len(written)
    assert all((volume / p).stat().st_mode & 0o777 == 0o600 for p in written)
    assert f"cat {SECRETS}/gateway/api_key" in first.replace(str(volume), SECRETS)
    assert f"cat {SECRETS}/client/nats_password" in first.replace(str(volume), SECRETS)
    assert not any(s in first for s in written.values())
    (volume / "client" / "nats_password").unlink()
    init.run_to_end()
    again = {p: (volume / p).read_text() for p in written}
    assert {p: s for p, s in again.items() if p != "client/nats_password"} == {
        p: s for p, s in written.items() if p != "client/nats_password"
    }
    assert again["client/nats_password"] != written["client/nats_password"]  # refilled


# ---------------------------------------------------------------------------------------
# compose, emulated: a container is a process with its mounts as local paths, its peers'
# host:port as loopback ports


@dataclass
class Network:
    """Where each compose host:port is reachable here (loopback ports), per service."""

    hosts: dict[str, str] = field(default_factory=dict)  # "nats-1:4222" -> "127.0.0.1:P"
    own: dict[str, dict[str, str]] = field(default_factory=dict)  # service -> its binds

    @classmethod
    def for_nodes(cls, nodes: list[str]) -> Network:
        net = cls()
        for node in nodes:
            client, route, http = free_port(), free_port(), free_port()
            net.hosts[f"{node}:4222"] = f"127.0.0.1:{client}"
            net.hosts[f"{node}:6222"] = f"127.0.0.1:{route}"
            # what the node binds and its healthcheck dials inside its container
            net.own[node] = {
                "0.0.0.0:6222": f"127.0.0.1:{route}",
                "127.0.0.1:8222": f"127.0.0.1:{http}",
                "--port": str(client),
                "--http_port": str(http),
            }
        return net


@dataclass
class Container:
    key: str
    spec: dict[str, Any]
    mounts: dict[str, Path]  # target -> the local path standing for it
    net: Network
    run_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def of(cls, compose: dict[str, Any], key: str, tmp: Path, net: Network) -> Container:
        spec = compose["services"][key]
        mounts = {}
        for mount in spec.get("volumes", []):
            source, target, subpath, _ = _volume(mount)
            # a bind mount is the repo's folder; a named volume a temp dir of the same name
            named = tmp / source / (subpath or "")
            mounts[target] = ROOT / source if source.startswith("./") else named
        run_dir = tmp / "run" / key  # the container's own /tmp: its health identity file
        run_dir.mkdir(parents=True, exist_ok=True)
        return cls(key, spec, mounts, net, run_dir, tmp / "logs" / f"{key}.log")

    def local(self, value: str) -> str:
        for target in sorted(self.mounts, key=len, reverse=True):  # a path, or one in a script
            path = re.compile(rf"(?<![\w/.-]){re.escape(target)}(?=/|\s|$)")
            value = path.sub(str(self.mounts[target]).replace("\\", r"\\"), value)
        for outside, here in (*self.net.own.get(self.key, {}).items(), *self.net.hosts.items()):
            if not outside.startswith("--"):
                value = value.replace(outside, here)
        return value

    def argv(self, parts: list[str]) -> list[str]:
        binds = self.net.own.get(self.key, {})
        out = []
        for i, part in enumerate(parts):
            flag = parts[i - 1] if i else ""
            out.append(binds[flag] if flag in binds else self.local(part))
        programs = {"rlt": [sys.executable, "-m", "services.cli"], "python": [sys.executable]}
        programs["nats-server"] = [find_nats_server()]
        return [*programs.get(out[0], [out[0]]), *out[1:]]

    def env(self) -> dict[str, str]:
        # a container's environment: compose's, and nothing of this shell's rlt settings
        base = {k: v for k, v in os.environ.items() if not k.startswith("RLT_")}
        base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # rlt
        spec_env = {
            k: self.local(_interpolate(str(v)))
            for k, v in (self.spec.get("environment") or {}).items()
        }
        return {**base, "RLT_RUN_DIR": str(self.run_dir), "OMP_NUM_THREADS": "1", **spec_env}

    def command(self) -> list[str]:
        return self.argv([*self.spec.get("entrypoint", []), *self.spec["command"]])

    def run_to_end(self) -> str:
        done = subprocess.run(self.command(), env=self.env(), capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout.decode()

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.env(),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.key} exited {self.proc.returncode}:\n{self.tail()}")
        test = self.spec["healthcheck"]["test"]
        assert test[0] == "CMD"
        if test[1] == "wget":  # not installed here: the same GET with urllib
            return _http(self.local(test[-1]))[0] == 200
        name = test[4]
        if not health_file(name, self.run_dir).exists():  # not ready: spare the CPU a check
            return False
        done = subprocess.run(self.argv(test[1:]), env=self.env(), capture_output=True)
        return done.returncode == 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # compose stop: SIGTERM, then SIGKILL
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def _http(url: str, data: dict[str, Any] | None = None, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, body, headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (urllib.error.URLError, ConnectionError):
        return 0, None


def _start_in_order(containers: dict[str, Container], timeout: float) -> None:
    """compose up: each container once what it depends on is healthy (or completed)."""
    healthy: set[str] = set()
    started: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(healthy) < len(containers):
        for key, c in containers.items():
            deps = set(c.spec.get("depends_on", {}))
            if key not in started and deps <= healthy:
                c.start()
                started.add(key)
        for key in started - healthy:
            if containers[key].healthy():
                healthy.add(key)
        if time.monotonic() > deadline:
            waiting = sorted(set(containers) - healthy)
            tails = "\n".join(f"--- {k}\n{containers[k].tail()}" for k in waiting)
            raise AssertionError(f"not healthy in {timeout}s: {waiting}\n{tails}")
        time.sleep(0.2)


@pytest.fixture()
def stack(
    compose: dict[str, Any], tmp_path: Path, toy_checkpoint: Path
) -> Iterator[dict[str, Container]]:
    net = Network.for_nodes(NATS_NODES)
    net.own["gateway"] = {"--http-host": "127.0.0.1", "--http-port": str(free_port())}
    # the checkpoints volume already holds the toy checkpoint: checkpoint-init keeps it
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "toy-checkpoint").symlink_to(toy_checkpoint)
    one_shots = {k: Container.of(compose, k, tmp_path, net) for k in ("init", "checkpoint-init")}
    for c in one_shots.values():
        c.run_to_end()
    keys = [
        k
        for k, s in compose["services"].items()
        if k not in one_shots and "profiles" not in s  # what `docker compose up` starts
    ]
    containers = {k: Container.of(compose, k, tmp_path, net) for k in keys}
    for c in containers.values():  # compose's dependencies that are done already
        c.spec = {**c.spec, "depends_on": set(c.spec.get("depends_on", {})) - set(one_shots)}
    try:
        _start_in_order(containers, timeout=150)
        yield containers
    finally:
        for c in reversed(list(containers.values())):
            c.stop()


@pytest.mark.slow
def test_compose_stack_serves(stack: dict[str, Container], tmp_path: Path) -> None:
    """The whole default stack, as compose runs it, from the secrets init wrote: NATS serves
    the client user with its password (`rlt generate`, as compose.yaml's header shows), the
    cluster's routes refuse a node without the route credentials, and the gateway serves a
    completion to the API key, and nothing without it."""
    secrets = tmp_path / "secrets"
    nodes = [stack["nats-1"].net.hosts[f"{n}:4222"] for n in NATS_NODES]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLT_")}
    env.update(
        RLT_NATS_USER="client",
        RLT_NATS_PASSWORD=(secrets / "client" / "nats_password").read_text(),
        RLT_CACHE_DIR=str(tmp_path / "client-cache"),
    )
    generate = [sys.executable, "-m", "services.cli", "generate",
                "--nats-url", ",".join(f"nats://{n}" for n in nodes)]  # fmt: skip
    done = subprocess.run(
        [*generate, "--max-tokens", "4", "--ignore-eos", "--json", "hello"],
        env=env, capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    finished = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert len(finished["token_ids"]) == 4, finished
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        url = f"nats://{nodes[0]}"
        asyncio.run(nats.connect(url, user="client", password="wrong", allow_reconnect=False))

    # every node is routed to the other two, and a node without the route password is not
    for node in NATS_NODES:
        _, routez = _http(f"http://{stack[node].local('127.0.0.1:8222')}/routez")
        peers = {r["remote_name"] for r in routez["routes"]}
        assert peers == set(NATS_NODES) - {node}, (node, peers)
    route = stack["nats-1"].net.hosts["nats-1:6222"]
    intruder = subprocess.Popen(
        [find_nats_server(), "-p", str(free_port()), "-n", "intruder", "--cluster_name", "rlt",
         "--cluster", f"nats://127.0.0.1:{free_port()}", "--routes", f"nats://{route}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # an unauthenticated route forms in milliseconds
        _, routez = _http(f"http://{stack['nats-1'].local('127.0.0.1:8222')}/routez")
        assert "intruder" not in {r["remote_name"] for r in routez["routes"]}
    finally:
        intruder.terminate()
        intruder.wait()

    key = (secrets / "gateway" / "api_key").read_text()
    gateway = stack["gateway"]
    base = f"http://127.0.0.1:{_flag(gateway.argv(gateway.spec['command']), '--http-port')}"
    status, models = _http(f"{base}/v1/models", key=key)
    assert status == 200, models
    body = {"model": models["data"][0]["id"], "prompt": "hello", "max_tokens": 4}
    status, out = _http(f"{base}/v1/completions", body, key=key)
    assert status == 200, out
    assert 1 <= out["usage"]["completion_tokens"] <= 4, out  # (the toy may stop early)
    assert _http(f"{base}/v1/models")[0] == 401
    assert _http(f"{base}/v1/models", key="not-the-key")[0] == 401


@pytest.mark.unit
def test_password_files_name_the_variables_nats_conf_reads(tmp_path: Path) -> None:
    """deploy/nats-entrypoint.sh exports RLT_NATS_<USER>_PASSWORD per folder, the name
    services.runtime.permissions gives it (and deploy/nats.conf reads), and the routes."""
    secrets = tmp_path / "secrets"
    for user in ("prefix-cache", "route", "tenant-acme"):
        (secrets / user).mkdir(parents=True)
        (secrets / user / "nats_password").write_text(f"pw{user.replace('-', '')}")
    env = {"PATH": os.environ["PATH"], "RLT_SECRETS_DIR": str(secrets),
           "RLT_NATS_ROUTES": "a:1,b:2"}  # fmt: skip
    out = subprocess.run(
        ["/bin/sh", str(ROOT / "deploy" / "nats-entrypoint.sh"), "env"],
        env=env, capture_output=True, check=True, text=True,
    ).stdout  # fmt: skip
    got = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("RLT_NATS_"))
    assert got[password_var("prefix-cache")] == "pwprefixcache"
    assert got[password_var("tenant-acme")] == "pwtenantacme"
    assert got["RLT_NATS_ROUTE_URLS"] == "[nats://route:pwroute@a:1, nats://route:pwroute@b:2]"
    (secrets / "route" / "nats_password").write_text("no/slash")
    bad = subprocess.run(
        ["/bin/sh", str(ROOT / "deploy" / "nats-entrypoint.sh"), "env"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode != 0 and "must be [A-Za-z0-9]+" in bad.stderr
