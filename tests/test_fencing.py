"""Isolation and fencing with REAL processes on a real nats-server:

- a request whose sampling cannot be computed in float32 is refused, and honest requests
  sharing batches with such requests all finish with the engine's tokens;
- a stalled scheduler answers once: stalled shorter than nats-server takes to drop it, its
  requests simply complete; stalled past that, admission ends each with ``unavailable`` and
  the resumed scheduler drops them without another event;
- an abort right after its generate, or even before it, ends the request with
  ``finish_reason: abort`` with prefix caching on;
- a worker serving a connected scheduler refuses another scheduler's batches;
- malformed public messages get an error reply; a huge trace id header goes nowhere.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from messages.batch import Batch, BatchKind
from messages.internal import WorkerBatch, WorkerResult
from services.launcher import NatsServer, free_port
from services.runtime import subjects
from services.runtime.bus import HEADER_TRACE_ID, decode_msgpack, encode_json, encode_msgpack

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

ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_SCHEDULER_LOST_S": "1.5",
    "RLT_RECONNECT_GRACE_S": "0.5",
}


def _server(tmp_path: Path, ping_s: int = 2) -> NatsServer:
    # nats-server drops a connection that answered none of its last ping_max pings:
    # here a stalled process is cut off 4-6 s into its stall
    conf = tmp_path / "nats.conf"
    conf.write_text(f'ping_interval: "{ping_s}s"\nping_max: 2\n')
    return NatsServer(port=free_port(), config_file=conf)


@pytest.mark.services
async def test_poison_values_are_refused_and_honest_batch_mates_finish(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """16 honest streams while poison requests (values float32 sampling turns into inf/NaN)
    arrive all the time: every poison gets ``invalid_request``, every honest request the
    engine's tokens. Before, each poison failed its whole batch with ``internal``."""
    poisons = [
        {"prompt_token_ids": [1], "max_tokens": 1, "temperature": 1e-300},
        {"prompt_token_ids": [2, 3], "max_tokens": 4, "temperature": 1.0, "top_p": 1e-46},
        {"prompt_token_ids": [4], "max_tokens": 2, "temperature": 1e-38},
    ]
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            cases = make_cases(7, 16, max_tokens=100)
            col = await StreamCollector(nc).start()
            bad = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"honest-{i}", ids, p))
            n = 0
            while not col.done(range(len(cases))):
                await bad.send(n, poisons[n % len(poisons)])
                n += 1
                await asyncio.sleep(0.05)
            await bad.wait_done(range(n), 30)
            for i in range(n):
                (terminal,) = bad.terminals(i)
                assert isinstance(terminal, ErrorEvent) and terminal.code == "invalid_request"
            await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")
        check_against_engine(col, cases, toy_checkpoint)
        assert n >= 8, n


@pytest.mark.slow
async def test_a_stalled_scheduler_answers_each_stream_once(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """SIGSTOP the scheduler mid-stream. A stall nats-server does not notice (2.5 s, past
    admission's 1.5 s loss time): nothing is ended, every request completes with the
    engine's tokens. A stall it notices (9 s or more: the connection is dropped after 4-6 s,
    later on a loaded machine): each
    client gets exactly one ``unavailable`` from admission, and nothing after it when the
    scheduler resumes (it asks admission and drops those requests); then it serves again."""
    with (
        _server(tmp_path) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            # ---- a short stall: nobody gives up on the scheduler
            cases = make_cases(11, 4, max_tokens=120)
            col = await StreamCollector(nc).start()
            idx = list(range(len(cases)))
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"short-{i}", ids, p))
            await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 60, "tokens")
            procs.kill("scheduler", signal.SIGSTOP)
            await asyncio.sleep(2.5)
            procs.kill("scheduler", signal.SIGCONT)
            await col.wait_done(idx, 90)
            await asyncio.sleep(1.0)  # a second terminal would have come by now
            check_against_engine(col, cases, toy_checkpoint, whole_streams=False)
            for i in idx:
                assert len(col.terminals(i)) == 1, col.events[i]

            # ---- a long stall: nats-server drops the scheduler, admission ends its requests
            cases = make_cases(12, 4, max_tokens=400)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"long-{i}", ids, p))
            await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 60, "tokens")
            procs.kill("scheduler", signal.SIGSTOP)
            stopped = time.monotonic()
            await col.wait_done(idx, 20)
            ended_after = time.monotonic() - stopped
            await asyncio.sleep(max(0.0, 9.0 - ended_after))
            procs.kill("scheduler", signal.SIGCONT)
            await wait_for(lambda: _fenced(nc), 20, "the resumed scheduler fenced its requests")
            await asyncio.sleep(1.5)  # anything it still sent would have arrived
            for i in idx:
                *tokens, terminal = col.events[i]
                assert all(isinstance(t, TokenEvent) for t in tokens), col.events[i]
                assert isinstance(terminal, ErrorEvent) and terminal.code == "unavailable"
            # not at admission's 1.5 s loss time: only once nats-server dropped the connection
            assert ended_after > 3.0, ended_after
            await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")

            # ---- and it serves again
            after = make_cases(13, 2, max_tokens=8)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(after):
                await col.send(i, as_request(f"after-{i}", ids, p))
            await col.wait_done([0, 1], 30)
            check_against_engine(col, after, toy_checkpoint)
        print(f"\nlong stall: clients told after {ended_after:.1f}s")


async def _fenced(nc) -> bool:  # type: ignore[no-untyped-def]
    try:  # while it reconnects nobody answers
        h = await health(nc, "scheduler", timeout=1.0)
    except Exception:
        return False
    return h["fenced_requests"] >= 4 and not h["dark"]


@pytest.mark.services
async def test_aborts_right_after_or_before_the_generate_end_it_with_prefix_caching(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    args = [*ENGINE_ARGS, "--enable-prefix-caching"]
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, args, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            col = await StreamCollector(nc).start()
            prompt = list(range(1, 40))  # whole blocks: prefix hits after the first
            n = 12
            for i in range(n):
                body = {"request_id": f"ab-{i}", "prompt_token_ids": prompt, "max_tokens": 500,
                        "ignore_eos": True, "temperature": 0.0}  # fmt: skip
                abort = encode_json({"request_id": f"ab-{i}"})
                if i % 2:  # the abort first: remembered, honoured when the request comes
                    await nc.publish(subjects.ABORT, abort)
                    await col.send(i, body)
                else:  # right after, on the same connection
                    await col.send(i, body)
                    await nc.publish(subjects.ABORT, abort)
            await col.wait_done(range(n), 30)
            await asyncio.sleep(0.3)
            for i in range(n):
                terminal = check_stream(col.events[i])
                assert isinstance(terminal, FinishedEvent), col.events[i]
                assert terminal.finish_reason == "abort", terminal
                assert len(terminal.token_ids) < 500
            await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")


@pytest.mark.services
async def test_worker_refuses_another_scheduler_and_bad_messages_get_answers(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            cases = make_cases(21, 3, max_tokens=60)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"w-{i}", ids, p))
            await wait_for(lambda: all(len(col.tokens(i)) >= 2 for i in range(3)), 60, "tokens")
            # another "scheduler" (a new epoch of another instance, a huge epoch number) sends
            # the bound worker a batch while the real scheduler is connected: refused
            worker_id = (await health(nc, "worker"))["worker_id"]
            forged = WorkerBatch(
                epoch="intruder.999999",
                batch=Batch(seq=0, kind=BatchKind.RECURRENT, rows=[]),
                epoch_start_seq=0,
                worker_id=worker_id,
            )
            reply = nc.new_inbox()
            sub = await nc.subscribe(reply)
            await nc.publish(subjects.worker_batch(worker_id), encode_msgpack(forged), reply=reply)
            answer = decode_msgpack((await sub.next_msg(timeout=5)).data, WorkerResult)
            assert answer.refused and "bound to scheduler" in answer.refused
            await col.wait_done(range(3), 60)
            check_against_engine(col, cases, toy_checkpoint)
            assert (await health(nc, "scheduler"))["worker_losses"] == 0

            # malformed public messages: an error reply each, and the services go on
            bad = await StreamCollector(nc).start()
            deep = b'{"request_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            await bad.send(0, deep, subjects.ABORT)
            await bad.send(1, deep, subjects.GENERATE)
            await bad.send(2, b"\xff", subjects.ABORT)
            await bad.wait_done([0, 1, 2], 10)
            for i in range(3):
                (terminal,) = bad.terminals(i)
                assert isinstance(terminal, ErrorEvent) and terminal.code == "invalid_request"
            # a huge trace id is not copied anywhere (a fresh one is made)
            huge = "t" * 600_000
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            body = encode_json({"prompt_token_ids": [5, 6], "max_tokens": 2})
            await nc.publish(subjects.GENERATE, body, reply=inbox, headers={HEADER_TRACE_ID: huge})
            while isinstance(decode := _event(await sub.next_msg(timeout=10)), TokenEvent):
                pass
            assert isinstance(decode, FinishedEvent)
        logs = {key: procs.logs(key) for key in procs.procs}
        assert all(huge[:1000] not in text for text in logs.values())
        assert all(p.alive() for p in procs.procs.values())


def _event(msg):  # type: ignore[no-untyped-def]
    import msgspec

    from tests.service_procs import Event

    return msgspec.json.decode(msg.data, type=Event)
