"""A three-node NATS cluster: real routes between real nats-server processes.

- an operator's own three nodes (the services did not start them): every service connects
  with all three URLs and makes the event stream R3; kill -9 one node mid-run: every request
  (sent with the client library) ends with exactly one terminal event and the tokens of an
  uninterrupted run, and the prefix index keeps its state (equal to the scheduler's table);
- ``rlt up --nats-cluster 3`` starts the three nodes itself and serves ``rlt generate``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from messages.api import FinishedEvent, TokenEvent
from services.client import RetryPolicy, stream_requests
from services.launcher import NatsCluster, free_port
from services.runtime import jetstream

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.service_cases import (  # noqa: E402  # noqa: E402
    PREFIX_ARGS,
    as_request,
    engine_config,
    index_matches_scheduler,
    make_cases,
    prefix_prompt,
)
from tests.service_procs import health, service_procs, start_rlt_up, wait_for  # noqa: E402

ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_RECONNECT_GRACE_S": "1.0",
    "RLT_SCHEDULER_LOST_S": "3.0",
    "RLT_PREFIX_SNAPSHOT_S": "0.5",
}


async def _connected_to(nc: nats.NATS, port: int) -> bool:
    url = nc.connected_url
    return url is not None and url.port == port


@pytest.mark.slow
async def test_node_killed_mid_run_every_request_ends_once_with_oracle_tokens(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    from services.engine.engine import LLMEngine

    with (
        NatsCluster(3) as cluster,
        service_procs(cluster.url, toy_checkpoint, tmp_path, PREFIX_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        nc = await nats.connect(cluster.url.split(","), reconnect_time_wait=0.2)
        try:
            info = await nc.jetstream().stream_info(jetstream.EVENT_STREAM)
            assert info.config.num_replicas == 3  # one per node
            # kill the node the most services are on: the worst case for the pipeline
            victim = _busiest_node(cluster)
            cases = make_cases(21, 6, max_tokens=400)
            requests = [
                as_request(f"node-{i}", prefix_prompt(40 + i), p) for i, (_, p) in enumerate(cases)
            ]
            seen: dict[int, list[int]] = {i: [] for i in range(len(requests))}
            terminals: dict[int, int] = {i: 0 for i in range(len(requests))}

            def on_event(i: int, event: object) -> None:
                if isinstance(event, TokenEvent):
                    seen[i].append(event.index)
                else:
                    terminals[i] += 1

            run = asyncio.ensure_future(
                stream_requests(
                    cluster.url,
                    requests,
                    timeout=120,
                    on_event=on_event,
                    retry=RetryPolicy(idle_s=5.0),
                )
            )
            # (on_event sees one request at a time, in input order: request 0 streams live)
            await wait_for(lambda: len(seen[0]) >= 3, 60, "tokens")
            killed_at = time.monotonic()
            cluster.kill(victim)
            assert not run.done()  # mid-run
            at_kill = {i: len(v) for i, v in seen.items()}
            results = await run
            took = time.monotonic() - killed_at
            try:
                # the index reads again once JetStream has new leaders: nats-server's Raft
                # groups (meta, the stream, the consumer) each wait 4-9 s for a lost leader
                # before electing, one after another in the worst case
                await wait_for(lambda: index_matches_scheduler(nc), 45, "index == scheduler")
            except TimeoutError:
                print(procs.logs("prefix-cache")[-3000:])
                raise
            index = await health(nc, "prefix-cache")
            admission = await health(nc, "admission")
            for key in ("prefix-cache", "scheduler"):
                for line in procs.logs(key).splitlines():
                    if any(w in line for w in ("missing", "rebased", "failed", "epoch", "lost")):
                        print(key, line[:300])
        finally:
            await nc.close()
        assert all(p.alive() for p in procs.procs.values())
    expected = LLMEngine.from_checkpoint(toy_checkpoint, engine_config()).generate(
        [r.prompt_token_ids for r in requests], [p for _, p in cases]
    )
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert isinstance(got, FinishedEvent), got
        assert terminals[i] == 1
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths)
        assert seen[i] == sorted(set(seen[i]))  # each token index passed on once, in order
    assert index["lost"] == 0 and index["gaps"] == 0
    print(
        f"\nnode {victim + 1} of 3 killed (tokens streamed by then: {list(at_kill.values())}): "
        f"all {len(results)} requests done {took:.1f}s later; "
        f"{admission['retries']} client retries"
    )


def _busiest_node(cluster: NatsCluster) -> int:
    """The node with the most rlt service connections (read from /proc's socket table is
    overkill: count established connections to each client port with ss-like parsing)."""
    counts = []
    for server in cluster.servers:
        counts.append(_established(server.port))
    return max(range(len(counts)), key=lambda i: counts[i])


def _established(port: int) -> int:
    """Established TCP connections to a local port (from /proc/net/tcp)."""
    hexport = f"{port:04X}"
    total = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if local.endswith(f":{hexport}") and state == "01":
                total += 1
    return total


@pytest.mark.services
def test_rlt_up_nats_cluster_3(tmp_path: Path, toy_checkpoint: Path) -> None:
    """``rlt up --nats-cluster 3``: three routed nodes (the routes authenticate), the event
    stream R3, ``rlt generate`` with every URL, then Ctrl-C stops the services and all three
    servers. Secured: the client and operator URLs come from the files rlt up writes."""
    port = free_port()
    while any(_port_taken(port + i) for i in range(3)):
        port = free_port()
    env = {
        **os.environ,
        "RLT_RUN_DIR": str(tmp_path),
        "RLT_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": "1",
    }
    cli = [sys.executable, "-m", "services.cli"]
    generate = ["generate", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--json"]
    log = tmp_path / "rlt-up.log"
    cmd = [*cli, "up", "--port", str(port), "--nats-cluster", "3"]
    cmd += ["--checkpoint", str(toy_checkpoint), "--enable-prefix-caching"]
    cmd += ["--client-url-file", str(tmp_path / "client-url")]
    cmd += ["--operator-url-file", str(tmp_path / "operator-url")]
    urls = ",".join(f"nats://127.0.0.1:{port + i}" for i in range(3))
    up, banner = start_rlt_up(cmd, env, log, timeout_s=90)
    try:
        assert urls in banner and "3-node cluster" in banner

        operator = (tmp_path / "operator-url").read_text().strip().split(",")[1]
        client_urls = (tmp_path / "client-url").read_text().strip()
        assert client_urls.count("@127.0.0.1:") == 3  # every node, with credentials

        async def cluster_facts() -> tuple[int, int]:
            nc = await nats.connect(operator)
            try:
                info = await nc.jetstream().stream_info(jetstream.EVENT_STREAM)
                peers = len(set(nc._server_info.get("connect_urls") or []))
                return info.config.num_replicas or 1, peers
            finally:
                await nc.close()

        replicas, peers = asyncio.run(cluster_facts())
        assert (replicas, peers) == (3, 3)
        gen = subprocess.run(
            [*cli, *generate, "--nats-url", client_urls],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert gen.returncode == 0, gen.stderr
        event = json.loads(gen.stdout.splitlines()[-1])
        assert event["type"] == "finished" and len(event["token_ids"]) == 3
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=40) == 0, log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    for i in range(3):
        assert not _port_taken(port + i)
    assert not (tmp_path / "client-url").exists() and not (tmp_path / "operator-url").exists()


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.services
def test_rlt_up_cluster_routes_refuse_a_node_without_the_route_password(tmp_path: Path) -> None:
    """rlt up's nodes authenticate their routes: a nats-server that routes to one of them
    without the route password never joins, while the real nodes route to each other."""
    from services.launcher import NatsServer
    from services.runtime.permissions import LocalAuth

    auth = LocalAuth.generate()
    conf = tmp_path / "nats.conf"
    conf.write_text(auth.config(cluster=True))
    with NatsCluster(3, config_file=conf, route_auth=auth.route) as cluster:
        node = cluster.servers[0]
        assert node.cluster_port is not None
        rogue = NatsServer(
            port=free_port(),
            server_name="rogue",
            cluster_name="rlt",
            cluster_port=free_port(),
            routes=[f"nats://127.0.0.1:{node.cluster_port}"],
        )
        with rogue:
            deadline = time.monotonic() + 10
            refused = False
            while time.monotonic() < deadline and not refused:
                log = Path(node.log_path).read_text(errors="replace")
                refused = "Authorization Violation" in log or "authentication error" in log
                time.sleep(0.1)
            assert refused, log[-2000:]
        routed = Path(node.log_path).read_text(errors="replace")
        assert routed.count("Route connection created") >= 2
