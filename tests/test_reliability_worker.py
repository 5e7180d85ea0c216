"""Worker failures with REAL processes (``rlt service NAME``) on a real nats-server.

- kill -9 the worker mid-generation, start a new worker process: every request completes
  with tokens and exit depths identical to an uninterrupted run (the in-process engine and
  the serial oracle), each token streamed exactly once, KV fully reclaimed;
- a hung worker (SIGSTOP: no heartbeats) is replaced the same way, and its late results
  after SIGCONT are ignored;
- with no worker at all, requests wait up to RLT_WORKER_WAIT_S, then end with
  ``unavailable``; a worker that comes back serves the next ones.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from messages.api import ErrorEvent, FinishedEvent
from services.launcher import NatsServer, free_port
from services.oracle import SerialOracle

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

ENV = {"RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5", "RLT_WORKER_HEARTBEAT_S": "0.25"}


async def test_worker_killed_or_hung_mid_generation_requests_complete_identically(
    toy_checkpoint: Path, oracle: SerialOracle, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            # ---- phase 1: kill -9 the worker process mid-generation
            cases = make_cases(1, 8, max_tokens=120)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"kill-{i}", ids, p))
            idx = list(range(len(cases)))
            await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 60, "tokens")
            procs.kill("worker")  # SIGKILL
            killed_at = time.monotonic()
            at_kill = [len(col.tokens(i)) for i in idx]
            assert any(n < 120 for n in at_kill), "nothing was mid-generation"
            replacement = procs.start("worker", key="worker-2")
            await procs.wait_ready(replacement)
            await col.wait_done(idx, 90)
            delay = time.monotonic() - killed_at
            h = await health(nc, "scheduler")
            assert h["worker_losses"] >= 1, h
            await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")
            check_against_engine(col, cases, toy_checkpoint, oracle)
            print(f"\nworker kill: tokens at kill {at_kill}; all done {delay:.1f}s after kill")

            # ---- phase 2: the worker hangs (SIGSTOP: no heartbeats, no results)
            cases2 = make_cases(2, 6, max_tokens=100)
            col2 = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases2):
                await col2.send(i, as_request(f"hang-{i}", ids, p))
            idx2 = list(range(len(cases2)))
            await wait_for(lambda: all(len(col2.tokens(i)) >= 2 for i in idx2), 60, "tokens")
            procs.kill("worker-2", signal.SIGSTOP)
            standby = procs.start("worker", key="worker-3")
            await procs.wait_ready(standby)
            await col2.wait_done(idx2, 90)
            # the hung worker wakes up: whatever it finishes belongs to a dead epoch
            procs.kill("worker-2", signal.SIGCONT)
            await asyncio.sleep(1.0)
            h = await health(nc, "scheduler")
            assert h["worker_losses"] >= 2, h
            await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")
            check_against_engine(col2, cases2, toy_checkpoint)
            for i in idx2:
                await asyncio.sleep(0)
                assert len(col2.terminals(i)) == 1  # still exactly one after SIGCONT


async def test_no_worker_requests_wait_then_unavailable_and_recover(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    env = {**ENV, "RLT_WORKER_WAIT_S": "2"}
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, env) as procs,
    ):
        await procs.start_all(["scheduler", "admission"])  # no worker at all
        async with client(server.url) as nc:
            col = await StreamCollector(nc).start()
            sent = time.monotonic()
            for i in range(3):
                await col.send(i, {"prompt_token_ids": [1, 2, 3 + i], "max_tokens": 4})
            await col.wait_done([0, 1, 2], 20)
            waited = time.monotonic() - sent
            for i in range(3):
                events = col.events[i]
                assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
                assert events[0].code == "unavailable" and "no worker" in events[0].message
            assert 1.8 <= waited < 10, waited  # they waited for a worker, then gave up
            assert await kv_reclaimed(nc)

            # a worker that arrives while requests wait serves them: delay, not an error.
            # (a scheduler that waits longer than a worker takes to boot on a busy box)
            procs.kill("scheduler", signal.SIGTERM)
            patient = procs.start("scheduler", env={"RLT_WORKER_WAIT_S": "120"}, key="sched-2")
            await procs.wait_ready(patient)
            await col.send(3, {"prompt_token_ids": [4, 5, 6], "max_tokens": 4, "ignore_eos": True})
            await asyncio.sleep(0.5)
            assert not col.events[3]  # it waits
            worker = procs.start("worker")
            await procs.wait_ready(worker)
            await col.wait_done([3], 60)
            terminal = check_stream(col.events[3])
            assert isinstance(terminal, FinishedEvent) and len(terminal.token_ids) == 4
