"""Engine shards with REAL processes (``rlt service NAME --shard ID``) on a real nats-server.

- three shards: mixed requests equal the in-process engine and the serial oracle token for
  token, they spread over the shards, and requests sharing a prefix land on the shard that
  holds it (``num_cached_tokens`` > 0, the same ``shard`` in their finished events);
- kill -9 one shard's worker mid-generation, and separately its scheduler: every stream
  ends with exactly one terminal event, no token index twice or missing, the tokens (and
  the log-probabilities of the streams that ask) equal an uninterrupted run; the shard's
  prefix blocks leave the index; a shard that comes back rejoins;
- the prefix index down: requests are still served (routing by load, said in the log);
- bad shard reports (malformed, stale, from an unknown shard) are ignored with a log line.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from msgspec.structs import replace

from messages.api import FinishedEvent, TokenEvent
from messages.internal import SchedulerLoad
from messages.sampling import SamplingParams
from services.engine.engine import LLMEngine
from services.launcher import NatsServer, free_port
from services.oracle import SerialOracle
from services.runtime import subjects
from services.runtime.bus import encode_msgpack

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.service_cases import (  # noqa: E402
    ENGINE_ARGS,
    as_request,
    check_against_engine,
    engine_config,
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

pytestmark = pytest.mark.services

ARGS = [*ENGINE_ARGS, "--enable-prefix-caching"]
ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_SCHEDULER_LOST_S": "1.5",
}


async def _healthy_shards(nc) -> set[str]:  # type: ignore[no-untyped-def]
    shards = (await health(nc, "admission"))["shards"]
    return {sid for sid, s in shards.items() if s["healthy"]}


async def _up(procs: ServiceProcs, nc, n: int) -> None:  # type: ignore[no-untyped-def]
    await procs.start_shards(n)
    want = {str(i) for i in range(n)}
    await wait_for(lambda: _has(nc, want), 30, f"{n} healthy shards")


async def _has(nc, want: set[str]) -> bool:  # type: ignore[no-untyped-def]
    return want <= await _healthy_shards(nc)


async def test_three_shards_equal_the_oracle_and_shared_prefixes_find_their_shard(
    toy_checkpoint: Path, oracle: SerialOracle, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ARGS, ENV) as procs,
    ):
        async with client(server.url) as nc:
            await _up(procs, nc, 3)
            cases = make_cases(11, 9, max_tokens=24)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"mix-{i}", ids, p))
            await col.wait_done(list(range(len(cases))), 90)
            check_against_engine(col, cases, toy_checkpoint, oracle)
            used = {col.terminals(i)[0].shard for i in range(len(cases))}  # type: ignore[union-attr]
            assert len(used) >= 2, used

            # a long shared prefix (8 blocks of 4), then requests that share it, one by one
            prefix = list(range(100, 132))
            shared = [([*prefix, 7 + j, 9, 11 + j], p) for j, (_, p) in enumerate(cases[:5])]
            col2 = await StreamCollector(nc).start()
            await col2.send(0, as_request("prefix-0", *shared[0]))
            await col2.wait_done([0], 60)
            first = check_stream(col2.events[0])
            assert isinstance(first, FinishedEvent)
            for j in range(1, len(shared)):
                # equal loads (the router weighs load too): then the holder must win
                await wait_for(lambda: _idle(nc), 10, "the shards' reports show them idle")
                await col2.send(j, as_request(f"prefix-{j}", *shared[j]))
                await col2.wait_done([j], 60)
                got = check_stream(col2.events[j])
                assert isinstance(got, FinishedEvent)
                assert got.shard == first.shard, (j, got.shard, first.shard)
                assert got.num_cached_tokens >= 16, got.num_cached_tokens
            check_against_engine(col2, shared, toy_checkpoint)
            # the index has the prefix for exactly that shard's producer
            index = (await health(nc, "prefix-cache"))["cached_blocks"]
            assert f"scheduler-{first.shard}" in index
            # a request scoring its prompt computes all of it, wherever it lands
            scoring = replace(shared[0][1], prompt_logprobs=0)
            await col2.send(9, as_request("prefix-scored", shared[0][0], scoring))
            await col2.wait_done([9], 60)
            got = check_stream(col2.events[9])
            assert isinstance(got, FinishedEvent) and got.num_cached_tokens == 0
            prompt_scores = col2.tokens(9)[0].prompt_logprobs
            assert [e.token_id for e in prompt_scores] == shared[0][0]
            assert all(e.logprob is not None for e in prompt_scores[1:])


async def _idle(nc) -> bool:  # type: ignore[no-untyped-def]
    shards = (await health(nc, "admission"))["shards"].values()
    return all(s["running"] == 0 and s["active_blocks"] == 0 for s in shards)


async def _kill_mid_run(
    procs: ServiceProcs,
    nc,
    key: str,
    tag: str,
    toy_checkpoint: Path,  # type: ignore[no-untyped-def]
) -> None:
    cases = make_cases(3, 8, max_tokens=150)
    # half of them with log-probabilities: they go on across the move, none lost or doubled
    cases = [(ids, replace(p, logprobs=2) if i % 2 == 0 else p) for i, (ids, p) in enumerate(cases)]
    col = await StreamCollector(nc).start()
    for i, (ids, p) in enumerate(cases):
        # 16+ tokens: whole blocks get cached and published to the prefix index
        await col.send(i, as_request(f"{tag}-{i}", [*range(1, 17), *ids], p))
    idx = list(range(len(cases)))
    await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 60, "tokens")
    before = (await health(nc, "admission"))["moved"]
    procs.kill(key)  # SIGKILL mid-generation
    await col.wait_done(idx, 90)
    await asyncio.sleep(0.5)  # a duplicate terminal would arrive by now
    for i in idx:
        check_stream(col.events[i])  # indices 0..n-1 once each, then exactly one terminal
    cases_with_prefix = [([*range(1, 17), *ids], p) for ids, p in cases]
    check_against_engine(col, cases_with_prefix, toy_checkpoint)
    _check_logprobs(col, cases_with_prefix, toy_checkpoint)
    moved = (await health(nc, "admission"))["moved"] - before
    assert moved > 0, "no request was on the killed shard"
    assert all(col.terminals(i)[0].shard == "1" for i in idx)  # type: ignore[union-attr]


def _check_logprobs(
    col: StreamCollector, cases: list[tuple[list[int], SamplingParams]], checkpoint: Path
) -> None:
    """Each stream that asked has every token's log-probabilities, equal to an
    uninterrupted in-process run's; the others have none."""
    engine = LLMEngine.from_checkpoint(checkpoint, engine_config())
    asked = [i for i, (_, p) in enumerate(cases) if p.logprobs is not None]
    for i in asked:
        engine.add_request(f"r{i}", cases[i][0], cases[i][1])
    expected: dict[str, list[TokenEvent]] = {}
    for event in engine.run_until_done():
        if isinstance(event, TokenEvent):
            expected.setdefault(event.request_id, []).append(event)
    for i in range(len(cases)):
        got = col.tokens(i)
        if i not in asked:
            assert all(e.logprobs is None for e in got)
            continue
        want = expected[f"r{i}"]
        assert [e.token_id for e in got] == [e.token_id for e in want]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs is not None and w.logprobs is not None
            assert g.logprobs.logprob == pytest.approx(w.logprobs.logprob, abs=1e-4)
            assert [t.token_id for t in g.logprobs.top_logprobs] == [
                t.token_id for t in w.logprobs.top_logprobs
            ]


async def _no_blocks_of(nc, producer: str) -> bool:  # type: ignore[no-untyped-def]
    return producer not in (await health(nc, "prefix-cache"))["cached_blocks"]


async def test_shard_worker_killed_its_requests_resume_on_another_shard(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ARGS, ENV) as procs,
    ):
        async with client(server.url) as nc:
            await _up(procs, nc, 2)
            await _kill_mid_run(procs, nc, "worker-0", "wk", toy_checkpoint)
            # its scheduler dropped its cache with the worker: the index followed
            await wait_for(lambda: _no_blocks_of(nc, "scheduler-0"), 10, "blocks dropped")
            # a worker for shard 0 comes back: the shard rejoins and serves again
            await procs.wait_ready(procs.start("worker", shard="0", key="worker-0b"))
            await wait_for(lambda: _has(nc, {"0", "1"}), 20, "shard 0 rejoins")
            await _serves_both(nc)


async def test_shard_scheduler_killed_its_requests_resume_on_another_shard(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ARGS, ENV) as procs,
    ):
        async with client(server.url) as nc:
            await _up(procs, nc, 2)
            await _kill_mid_run(procs, nc, "scheduler-0", "sk", toy_checkpoint)
            # its reports stopped: the index dropped its blocks, admission dropped the shard
            await wait_for(lambda: _no_blocks_of(nc, "scheduler-0"), 10, "blocks dropped")
            assert "0" not in (await health(nc, "admission"))["shards"]
            sched = procs.start("scheduler", shard="0", key="scheduler-0b")
            await procs.wait_ready(sched)
            await wait_for(lambda: _has(nc, {"0", "1"}), 20, "shard 0 rejoins")
            await _serves_both(nc)


async def _serves_both(nc, tag: str = "after") -> None:  # type: ignore[no-untyped-def]
    """Requests complete, and the router uses both shards again."""
    cases = make_cases(21, 6, max_tokens=6)
    col = await StreamCollector(nc).start()
    for i, (ids, p) in enumerate(cases):
        await col.send(i, as_request(f"{tag}-{i}", ids, p))
    await col.wait_done(list(range(len(cases))), 60)
    shards = set()
    for i in range(len(cases)):
        terminal = check_stream(col.events[i])
        assert isinstance(terminal, FinishedEvent), terminal
        shards.add(terminal.shard)
    assert shards == {"0", "1"}, shards


async def test_bad_reports_are_ignored_and_requests_survive_the_index_going_down(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ARGS, ENV) as procs,
    ):
        async with client(server.url) as nc:
            await _up(procs, nc, 2)
            shard0 = (await health(nc, "admission"))["shards"]["0"]
            bad = [
                b"\x93not a report",
                encode_msgpack(
                    SchedulerLoad(scheduler_id="nobody", shard_id="ghost", report_seq=10**9)
                ),
                encode_msgpack(  # an old report of a real shard: must not undo newer ones
                    SchedulerLoad(
                        scheduler_id=shard0["scheduler"],
                        shard_id="0",
                        report_seq=1,
                        num_waiting=10**6,
                        has_worker=False,
                    )
                ),
            ]
            for data in bad:
                await nc.publish(subjects.SCHED_LOAD, data)
            await nc.flush()
            logs = lambda: procs.logs("admission")  # noqa: E731
            for what in ("(malformed)", "(unknown shard)", "(stale)"):
                await wait_for(lambda what=what: f"bad load report ignored {what}" in logs(), 10,
                               what)  # fmt: skip
            shards = (await health(nc, "admission"))["shards"]
            assert set(shards) == {"0", "1"} and shards["0"]["waiting"] < 10**6
            await _serves_both(nc)

            # the prefix index goes away: requests are still served, by load
            procs.kill("prefix-cache")
            await _serves_both(nc, "no-index")
            assert "prefix index unreachable; routing by load only" in logs()
            assert (await health(nc, "admission"))["prefix_index_down"]
