"""Prefill/decode disaggregation with REAL processes on a real nats-server: shard 0 is a
prefill shard, shard 1 a decode shard (``rlt service scheduler|worker --role``); the KV
moves between the two worker processes with NIXL.

- every request (greedy, early exit, logprobs) equals the in-process engine token for
  token, streams each index once, and finishes on the decode shard with its prompt KV
  pulled, not computed; both shards' KV returns to full;
- faults: the prefill worker killed (kill -9) while handed-off requests wait for the
  decode worker (stopped), then the decode worker killed mid-decode: every request still
  finishes exactly once with the same tokens (prefilled again where the KV was lost), and
  no block leaks on either side.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from msgspec.structs import replace

from messages.api import FinishedEvent
from services.worker.kv_transfer import nixl_available

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.service_cases import (  # noqa: E402
    PREFIX_ARGS,
    as_request,
    check_against_engine,
    make_cases,
)
from tests.service_procs import (  # noqa: E402
    ServiceProcs,
    StreamCollector,
    client,
    health,
    service_procs,
    wait_for,
)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_SCHEDULER_LOST_S": "1.5",
}


async def _up(procs: ServiceProcs, nc) -> None:  # type: ignore[no-untyped-def]
    started = [procs.start("prefix-cache")]
    for shard, role in (("0", "prefill"), ("1", "decode")):
        for name in ("worker", "scheduler"):
            started.append(procs.start(name, shard=shard, args=["--role", role]))
    started.append(procs.start("admission"))
    for proc in started:
        await procs.wait_ready(proc, timeout=120.0)
    await wait_for(lambda: _healthy(nc, {"0", "1"}), 30, "both shards healthy")


async def _healthy(nc, want: set[str]) -> bool:  # type: ignore[no-untyped-def]
    shards = (await health(nc, "admission"))["shards"]
    return want <= {sid for sid, s in shards.items() if s["healthy"]}


async def _shard_health(nc, name: str, shard: str) -> dict:  # type: ignore[no-untyped-def]
    return await health(nc, f"{name}.{shard}")


async def _reclaimed(nc) -> bool:  # type: ignore[no-untyped-def]
    for shard in ("0", "1"):
        h = await _shard_health(nc, "scheduler", shard)
        if h["live_requests"] or h["free_kv_blocks"] != h["num_kv_blocks"]:
            return False
        if h["handoffs_held"] or h["kv_pulls_open"]:
            return False
    return True


@pytest.mark.services
async def test_prefill_and_decode_shards_equal_the_engine(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with nats_server_and_procs(toy_checkpoint, tmp_path) as (server, procs):
        async with client(server.url) as nc:
            await _up(procs, nc)
            cases = make_cases(44, 8, max_tokens=12)
            cases[2] = (cases[2][0], replace(cases[2][1], logprobs=2))
            shared = list(range(100, 124))  # a prefix both shards come to cache
            cases += [([*shared, 7 + j, 9], cases[j][1]) for j in range(3)]
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"pd-{i}", ids, p))
                if i >= len(cases) - 3:
                    await col.wait_done([i], 60)  # one by one: the prefix is cached by then
            await col.wait_done(list(range(len(cases))), 120)
            check_against_engine(col, cases, toy_checkpoint)
            for i in range(len(cases)):
                final = check_stream(col.events[i])
                assert isinstance(final, FinishedEvent) and final.shard == "1", final
            assert col.tokens(2)[0].logprobs is not None  # the first token's, from shard 0
            prefill = await _shard_health(nc, "scheduler", "0")
            decode = await _shard_health(nc, "scheduler", "1")
            worker = await _shard_health(nc, "worker", "1")
            assert prefill["handed_off"] == len(cases), prefill
            assert decode["kv_pulled"] == len(cases), decode
            assert decode["kv_pull_failures"] == 0
            assert worker["kv_pulls"] == len(cases) and worker["kv_bytes_pulled"] > 0
            await wait_for(lambda: _reclaimed(nc), 15, "KV back to full on both shards")


@pytest.mark.slow  # ~27 s: two worker restarts
async def test_lost_kv_is_recomputed_and_every_request_ends_once(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with nats_server_and_procs(toy_checkpoint, tmp_path) as (server, procs):
        async with client(server.url) as nc:
            await _up(procs, nc)
            cases = make_cases(45, 6, max_tokens=40)
            col = await StreamCollector(nc).start()
            # the decode worker is stopped: handed-off requests wait for their pulls
            procs.kill("worker-1", signal.SIGSTOP)
            for i, (ids, p) in enumerate(cases[:3]):
                await col.send(i, as_request(f"lost-{i}", ids, p))
            await wait_for(
                lambda: _handed_off(nc, 3), 30, "three requests handed to the decode shard"
            )
            # the prefill worker dies holding their KV; the decode worker comes back
            procs.kill("worker-0")
            procs.kill("worker-1", signal.SIGCONT)
            procs.start("worker", shard="0", args=["--role", "prefill"])
            await col.wait_done([0, 1, 2], 90)
            # now the decode worker dies mid-decode
            for i, (ids, p) in enumerate(cases[3:], start=3):
                await col.send(i, as_request(f"lost-{i}", ids, p))
            await wait_for(lambda: any(col.tokens(i)[3:] for i in range(3, 6)), 60, "decoding")
            procs.kill("worker-1")
            procs.start("worker", shard="1", args=["--role", "decode"])
            await col.wait_done(list(range(len(cases))), 120)
            check_against_engine(col, cases, toy_checkpoint)
            decode = await _shard_health(nc, "scheduler", "1")
            assert decode["kv_pull_failures"] >= 1, decode  # the dead source's pulls
            await wait_for(lambda: _healthy(nc, {"0", "1"}), 30, "both shards back")
            await wait_for(lambda: _reclaimed(nc), 20, "KV back to full on both shards")


async def _handed_off(nc, n: int) -> bool:  # type: ignore[no-untyped-def]
    return (await _shard_health(nc, "scheduler", "0"))["handed_off"] >= n


class nats_server_and_procs:
    def __init__(self, checkpoint: Path, workdir: Path) -> None:
        from services.launcher import NatsServer, free_port

        self._server = NatsServer(port=free_port())
        self._checkpoint, self._workdir = checkpoint, workdir
        self._procs = None

    def __enter__(self):  # type: ignore[no-untyped-def]
        server = self._server.__enter__()
        self._procs = service_procs(server.url, self._checkpoint, self._workdir, PREFIX_ARGS, ENV)
        return server, self._procs.__enter__()

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        try:
            assert self._procs is not None
            self._procs.__exit__(*exc)
        finally:
            self._server.__exit__(*exc)


_ = asyncio  # the tests are coroutines (pytest-asyncio's auto mode)
