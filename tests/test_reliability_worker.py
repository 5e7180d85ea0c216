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
import random
import signal
import time
from pathlib import Path

import pytest

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest
from messages.sampling import SamplingParams
from services.cli import build_parser
from services.common.flags import scheduler_config_from_args
from services.engine.engine import LLMEngine
from services.launcher import NatsServer, free_port
from services.oracle import SerialOracle

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.service_procs import (  # noqa: E402
    StreamCollector,
    client,
    health,
    service_procs,
    wait_for,
)

ENGINE_ARGS = [
    "--wavefront-chunked-prefill",
    "--prefill-chunk-size",
    "4",
    "--async-scheduling",
    "--block-size",
    "4",
    "--num-blocks",
    "1024",
    "--max-num-batched-tokens",
    "32",
    "--max-num-seqs",
    "8",
]
ENV = {"RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5", "RLT_WORKER_HEARTBEAT_S": "0.25"}


def _config():  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["service", "worker", *ENGINE_ARGS])
    return scheduler_config_from_args(args)


def _cases(seed: int, n: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 14))]
        exit_policy = {"min_loops": 1, "exit_threshold": 0.7} if i % 2 else {}
        out.append(
            (
                prompt,
                SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **exit_policy
                ),
            )
        )
    return out


def _request(rid: str, ids: list[int], p: SamplingParams) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        min_loops=p.min_loops,
        exit_threshold=p.exit_threshold,
        ignore_eos=p.ignore_eos,
    )


def _check_against_engine(
    col: StreamCollector,
    cases: list[tuple[list[int], SamplingParams]],
    checkpoint: Path,
    oracle: SerialOracle | None = None,
    *,
    whole_streams: bool = True,
) -> None:
    expected = LLMEngine.from_checkpoint(checkpoint, _config()).generate(
        [ids for ids, _ in cases], [p for _, p in cases]
    )
    for i, want in enumerate(expected):
        if whole_streams:
            terminal = check_stream(col.events[i])  # each token once, in order, one terminal
        else:
            (terminal,) = col.terminals(i)
        assert isinstance(terminal, FinishedEvent), terminal
        assert (terminal.token_ids, terminal.exit_depths) == (want.token_ids, want.exit_depths)
    if oracle is not None:
        for i in (0, 1):
            ids, p = cases[i]
            ref = oracle.generate(
                ids,
                max_tokens=p.max_tokens,
                min_loops=p.min_loops,
                exit_threshold=p.exit_threshold,
                ignore_eos=True,
            )
            got = col.terminals(i)[0]
            assert isinstance(got, FinishedEvent)
            assert (got.token_ids, got.exit_depths) == (ref.token_ids, ref.exit_depths)


async def _reclaimed(nc) -> bool:  # type: ignore[no-untyped-def]
    h = await health(nc, "scheduler")
    return h["live_requests"] == 0 and h["free_kv_blocks"] == h["num_kv_blocks"]


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
            cases = _cases(1, 8, max_tokens=120)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, _request(f"kill-{i}", ids, p))
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
            await wait_for(lambda: _reclaimed(nc), 10, "KV reclaimed")
            _check_against_engine(col, cases, toy_checkpoint, oracle)
            print(f"\nworker kill: tokens at kill {at_kill}; all done {delay:.1f}s after kill")

            # ---- phase 2: the worker hangs (SIGSTOP: no heartbeats, no results)
            cases2 = _cases(2, 6, max_tokens=100)
            col2 = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases2):
                await col2.send(i, _request(f"hang-{i}", ids, p))
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
            await wait_for(lambda: _reclaimed(nc), 10, "KV reclaimed")
            _check_against_engine(col2, cases2, toy_checkpoint)
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
            assert await _reclaimed(nc)

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
