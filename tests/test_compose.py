"""compose.yaml and Dockerfile agree with the CLI and the runtime (no Docker needed).

Every rlt service command must parse with the real CLI parser, every service must have an
honest healthcheck and wait for a healthy NATS, and all services share one checkpoint volume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import build_parser
from services.runtime import subjects
from services.runtime.health import main as health_main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RLT_SERVICES = set(subjects.SERVICE_NAMES)  # ... and gateway
NATS_NODES = ["nats-1", "nats-2", "nats-3"]
NATS_URLS = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_and_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert RLT_SERVICES | set(NATS_NODES) <= set(services)
    assert "checkpoints" in compose["volumes"]
    for name in RLT_SERVICES:
        mounts = services[name].get("volumes", [])
        assert any(str(m).startswith("checkpoints:") for m in mounts), name


def test_commands_parse_with_the_cli(compose: dict[str, Any]) -> None:
    parser = build_parser()
    services = compose["services"]
    for name in RLT_SERVICES:
        command = compose["services"][name]["command"]
        assert command[0] == "rlt", command
        args = parser.parse_args(command[1:])
        assert args.command == "service" and args.name == name
        assert args.nats_url == NATS_URLS  # every node: a lost one fails over
        assert services[name]["environment"]["RLT_NATS_URL"] == NATS_URLS
        if name != "prefix-cache":
            # everyone reads the checkpoint the init step writes into the shared volume
            assert args.checkpoint == "/data/toy-checkpoint"
    init = compose["services"]["checkpoint-init"]
    script = " ".join(init["command"])
    assert "rlt toy-checkpoint /data/toy-checkpoint" in script
    assert parser.parse_args(["toy-checkpoint", "/data/toy-checkpoint"]).dir


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
    for name in RLT_SERVICES:
        svc = services[name]
        for node in NATS_NODES:
            assert svc["depends_on"][node]["condition"] == "service_healthy", (name, node)
        if name != "prefix-cache":
            cond = svc["depends_on"]["checkpoint-init"]["condition"]
            assert cond == "service_completed_successfully"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        # the check module exists and takes exactly these arguments (the service's own name)
        assert test[1:4] == ["python", "-m", "services.runtime.health"]
        assert test[4] == name
        assert test[5:] == ["--nats-url", NATS_URLS]
        assert health_main([*test[4:], "--timeout", "0.1"]) == 1  # nothing runs here
    assert services["admission"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_two_shards(
    compose: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shard 0 (worker, scheduler) and shard 1 (worker-1, scheduler-1): the same commands
    with their --shard, healthchecks of their own, admission waiting for both schedulers."""
    monkeypatch.setenv("RLT_RUN_DIR", str(tmp_path))
    parser = build_parser()
    services = compose["services"]
    shards: dict[str, set[str]] = {}
    for key in ("worker", "scheduler", "worker-1", "scheduler-1"):
        args = parser.parse_args(services[key]["command"][1:])
        shards.setdefault(args.shard, set()).add(args.name)
        test = services[key]["healthcheck"]["test"]
        assert test[1:5] == ["python", "-m", "services.runtime.health", args.name], key
    assert shards == {"0": {"worker", "scheduler"}, "1": {"worker", "scheduler"}}
    depends = services["admission"]["depends_on"]
    assert depends["scheduler-1"]["condition"] == "service_healthy"
    admission = parser.parse_args(services["admission"]["command"][1:])
    assert admission.router == "prefix"


def test_dockerfile_builds_one_image_for_all_services() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert "download.pytorch.org/whl/cpu" in text
    for folder in ("services", "messages", "kernels"):
        assert f"COPY {folder}" in text


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_three_nats_nodes_form_one_jetstream_cluster(compose: dict[str, Any]) -> None:
    """Three nats-server nodes, each routed to the other two, one cluster name, a server
    name and a store volume of its own (JetStream clustering needs all of these), each client
    port on its own loopback port, so `rlt generate` can be given all three."""
    services = compose["services"]
    commands = {node: services[node]["command"] for node in NATS_NODES}
    names = {_flag(c, "--server_name") for c in commands.values()}
    assert names == set(NATS_NODES)
    assert {_flag(c, "--cluster_name") for c in commands.values()} == {"rlt"}
    for node, command in commands.items():
        assert _flag(command, "--cluster") == "nats://0.0.0.0:6222"
        routes = set(_flag(command, "--routes").split(","))
        # routes authenticate (deploy/nats.conf's cluster block) with the route password
        creds = "route:${RLT_NATS_ROUTE_PASSWORD}@"
        assert routes == {f"nats://{creds}{other}:6222" for other in NATS_NODES if other != node}
        assert "/etc/nats/nats.conf" in command  # users and permissions on every node
    stores = [
        next(v for v in services[n]["volumes"] if str(v).endswith(":/jetstream"))
        for n in NATS_NODES
    ]
    assert len(set(stores)) == 3
    assert {str(v).split(":")[0] for v in stores} <= set(compose["volumes"])
    published = [p for n in NATS_NODES for p in services[n]["ports"]]
    assert all(str(p).startswith("127.0.0.1:") for p in published)
    assert len({str(p).split(":")[1] for p in published}) == len(published)  # no clash
