"""Bus and scheduler failures with REAL processes on a real nats-server.

- nats-server killed and restarted mid-run on the same port: every service reconnects and
  every request ends with exactly one terminal event; the requests complete (the scheduler
  holds client events while the bus is down and sends them after a grace period, and
  recomputes any batch or result lost in the outage), with the tokens of an uninterrupted run;
- the scheduler killed (-9) mid-run: admission ends each request it held with exactly one
  ``unavailable`` error; a new scheduler (new epoch) serves new requests, the worker resets,
  and the prefix cache drops the old epoch's blocks.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from services.launcher import NatsServer, free_port

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.service_cases import (  # noqa: E402
    ENGINE_ARGS,
    as_request,
    check_against_engine,
    kv_reclaimed,
    make_cases,
)
from tests.service_procs import (  # noqa: E402
    StreamCollector,
    client,
    health,
    service_procs,
    wait_for,
)

pytestmark = pytest.mark.services

ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_RECONNECT_GRACE_S": "1.0",
    "RLT_SCHEDULER_LOST_S": "1.5",
}


async def test_nats_restart_mid_run_every_request_ends_once(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    port = free_port()
    server = NatsServer(port=port).start()
    try:
        with service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, ENV) as procs:
            await procs.start_all()
            async with client(server.url) as nc:
                cases = make_cases(3, 8, max_tokens=150)
                col = await StreamCollector(nc).start()
                for i, (ids, p) in enumerate(cases):
                    await col.send(i, as_request(f"bus-{i}", ids, p))
                idx = list(range(len(cases)))
                await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 60, "tokens")
                server.proc.kill()  # type: ignore[union-attr]  # crash, not a clean stop
                server.proc.wait()  # type: ignore[union-attr]
                at_crash = [len(col.tokens(i)) for i in idx]
                down_at = time.monotonic()
                await asyncio.sleep(1.0)
                server.stop()
                server = NatsServer(port=port).start()  # same port: everyone reconnects
                await col.wait_done(idx, 60)
                took = time.monotonic() - down_at
                await asyncio.sleep(0.5)  # a duplicate terminal would arrive by now
                gaps = 0
                for i in idx:
                    terminals = col.terminals(i)
                    assert len(terminals) == 1, col.events[i]
                    assert isinstance(terminals[0], FinishedEvent), terminals
                    # token events in flight inside the dying server may be lost; the
                    # finished event carries the whole output
                    streamed = [e.index for e in col.events[i] if isinstance(e, TokenEvent)]
                    assert streamed == sorted(set(streamed))
                    gaps += len(terminals[0].token_ids) - len(streamed)
                await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")
                assert all(p.alive() for p in procs.procs.values())
        # same outputs as an uninterrupted run (the finished events' token lists)
        check_against_engine(col, cases, toy_checkpoint, whole_streams=False)
        print(
            f"\nnats restart: tokens at crash {at_crash}; done {took:.1f}s later; "
            f"{gaps} token events lost in flight"
        )
    finally:
        server.stop()


async def test_scheduler_killed_clients_get_unavailable_and_new_epoch_serves(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    args = [*ENGINE_ARGS, "--enable-prefix-caching"]
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, args, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            cases = make_cases(4, 6, max_tokens=300)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                # 16+ tokens: whole blocks get cached and published to the prefix cache
                await col.send(i, as_request(f"sched-{i}", [*range(1, 17), *ids], p))
            idx = list(range(len(cases)))
            await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 60, "tokens")

            async def cached_blocks() -> dict[str, int]:
                return (await health(nc, "prefix-cache"))["cached_blocks"]

            await wait_for(cached_blocks, 10, "blocks in the prefix cache")
            procs.kill("scheduler")  # SIGKILL mid-generation
            await col.wait_done(idx, 20)
            await asyncio.sleep(0.5)
            for i in idx:
                terminals = col.terminals(i)
                assert len(terminals) == 1, col.events[i]
                assert isinstance(terminals[0], ErrorEvent), terminals
                assert terminals[0].code == "unavailable"
            assert (await health(nc, "admission"))["open_requests"] == 0

            # a new scheduler: a new epoch; the old one's prefix blocks are dropped
            new = procs.start("scheduler", key="scheduler-2")
            await procs.wait_ready(new)
            await wait_for(
                lambda: _no_blocks(nc), 10, "old epoch's blocks dropped from the prefix cache"
            )
            cases2 = make_cases(5, 3, max_tokens=12)
            col2 = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases2):
                await col2.send(i, as_request(f"after-{i}", ids, p))
            await col2.wait_done([0, 1, 2], 30)
            check_against_engine(col2, cases2, toy_checkpoint)
            for i in range(3):
                check_stream(col2.events[i])


async def _no_blocks(nc) -> bool:  # type: ignore[no-untyped-def]
    return not (await health(nc, "prefix-cache"))["cached_blocks"]
