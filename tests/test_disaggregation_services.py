"""Prefill/decode disaggregation with REAL processes on a real nats-server: shard 0 is a
prefill shard, shard 1 a decode shard (``rlt service scheduler|worker --role``); the KV
moves between the two worker processes with NIXL.

- every request (greedy, early exit, seeded sampling, logprobs, structured outputs)
  equals the in-process engine token for token (log-probabilities to rounding), streams
  each index once, and finishes on the decode shard with its prompt KV pulled, not
  computed; both shards' KV returns to full;
- faults (slow): the prefill worker killed (kill -9) while handed-off requests wait for
  the decode worker (stopped), then the decode worker killed mid-decode; the prefill
  worker killed DURING a pull (the decode worker holds each pull between its chunks,
  ``RLT_KV_TRANSFER_TEST_HOLD_S``, so the kill lands mid-pull); a pull that times out
  because its source stalled (SIGSTOP, over TCP, a 1.5 s deadline): every request still
  finishes exactly once with the same tokens (prefilled again where the KV was lost),
  and no block leaks on either side.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from msgspec.structs import replace

from kernels.kv_codec import block_bytes
from messages.api import FinishedEvent, GenerateRequest, TokenEvent
from messages.sampling import SamplingParams, StructuredOutput
from services.cli import build_parser
from services.common.flags import scheduler_config_from_args
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.worker.kv_transfer.agent import nixl_available
from services.worker.model.toy import toy_config

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.engine_harness import assert_matches_oracle, oracle_result  # noqa: E402
from tests.helpers import FORMATS, assert_follows  # noqa: E402
from tests.service_cases import (  # noqa: E402
    ENGINE_ARGS,
    PREFIX_ARGS,
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

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_SCHEDULER_LOST_S": "1.5",
}


async def _up(procs: ServiceProcs, nc, envs: dict[str, dict[str, str]] | None = None) -> None:  # type: ignore[no-untyped-def]
    """Shard 0 prefills, shard 1 decodes; ``envs``: extra environment by process key."""
    envs = envs or {}
    started = [procs.start("prefix-cache")]
    for shard, role in (("0", "prefill"), ("1", "decode")):
        for name in ("worker", "scheduler"):
            env = envs.get(f"{name}-{shard}")
            started.append(procs.start(name, env=env, shard=shard, args=["--role", role]))
    started.append(procs.start("admission"))
    for proc in started:
        await procs.wait_ready(proc, timeout=120.0)
    await wait_for(lambda: _healthy(nc, {"0", "1"}), 30, "both shards healthy")


async def _healthy(nc, want: set[str]) -> bool:  # type: ignore[no-untyped-def]
    shards = (await health(nc, "admission"))["shards"]
    return want <= {sid for sid, s in shards.items() if s["healthy"]}


def engine_config_from(args: list[str]):  # type: ignore[no-untyped-def]
    return scheduler_config_from_args(build_parser().parse_args(["service", "worker", *args]))


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


def _request(rid: str, ids: list[int], p: SamplingParams) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt_token_ids=ids, max_tokens=p.max_tokens,
        temperature=p.temperature, top_k=p.top_k, seed=p.seed, min_loops=p.min_loops,
        exit_threshold=p.exit_threshold, ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        structured_output=p.structured_output,
    )  # fmt: skip


def _special_cases() -> list[tuple[list[int], SamplingParams]]:
    """Across the handoff: a structured output (greedy) and one sampled with a seed, seeded
    sampling with log-probabilities, greedy with early exit and log-probabilities."""
    json_kind, json_spec = FORMATS["json_schema"]
    regex_kind, regex_spec = FORMATS["regex"]
    return [
        ([11, 305, 27, 9], SamplingParams(
            max_tokens=256, temperature=0.0,
            structured_output=StructuredOutput(kind=json_kind, spec=json_spec),
        )),
        ([40, 41, 42, 43, 44, 45], SamplingParams(
            max_tokens=64, temperature=1.0, seed=7,
            structured_output=StructuredOutput(kind=regex_kind, spec=regex_spec),
        )),
        ([88, 7, 301], SamplingParams(
            max_tokens=10, temperature=0.9, top_k=20, seed=1234, logprobs=3, ignore_eos=True,
        )),
        ([5, 9, 33, 71, 2], SamplingParams(
            max_tokens=10, temperature=0.0, min_loops=1, exit_threshold=0.6, logprobs=2,
            ignore_eos=True,
        )),
    ]  # fmt: skip


def _check_special(col: StreamCollector, first: int, checkpoint: Path) -> None:
    """Tokens, exit depths and log-probabilities equal the in-process engine's (one
    colocated engine, the same config); structured outputs follow their format."""
    cases = _special_cases()
    codec = TextCodec.from_checkpoint(checkpoint)
    engine = LLMEngine.from_checkpoint(checkpoint, engine_config(), codec=codec)
    for i, (ids, p) in enumerate(cases):
        engine.core.add_request(f"x{i}", ids, p)
    events = engine.run_until_done()
    for i, (_, p) in enumerate(cases):
        want = [e for e in events if isinstance(e, TokenEvent) and e.request_id == f"x{i}"]
        (done,) = [e for e in events if isinstance(e, FinishedEvent) and e.request_id == f"x{i}"]
        final = check_stream(col.events[first + i])
        assert isinstance(final, FinishedEvent) and final.shard == "1", final
        assert (final.token_ids, final.exit_depths) == (done.token_ids, done.exit_depths), i
        got = col.tokens(first + i)
        assert [e.token_id for e in got] == [e.token_id for e in want]
        if p.structured_output is not None:
            assert final.finish_reason == "stop", (i, final)
            kind, spec = p.structured_output.kind, p.structured_output.spec
            assert_follows(kind, spec, codec.decode(final.token_ids))
        if p.logprobs:
            for mine, theirs in zip(got, want, strict=True):
                a, b = mine.logprobs, theirs.logprobs
                assert a is not None and b is not None, (i, mine.index)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]


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
            special = _special_cases()
            for j, (ids, p) in enumerate(special):
                await col.send(len(cases) + j, _request(f"pd-x{j}", ids, p))
            everything = list(range(len(cases) + len(special)))
            await col.wait_done(everything, 120)
            check_against_engine(col, cases, toy_checkpoint)
            _check_special(col, len(cases), toy_checkpoint)
            for i in range(len(cases)):
                final = check_stream(col.events[i])
                assert isinstance(final, FinishedEvent) and final.shard == "1", final
            assert col.tokens(2)[0].logprobs is not None  # the first token's, from shard 0
            prefill = await _shard_health(nc, "scheduler", "0")
            decode = await _shard_health(nc, "scheduler", "1")
            worker = await _shard_health(nc, "worker", "1")
            n = len(everything)
            assert prefill["handed_off"] == n, prefill
            assert decode["kv_pulled"] == n, decode
            assert decode["kv_pull_failures"] == 0
            assert worker["kv_pulls"] == n and worker["kv_bytes_pulled"] > 0
            await wait_for(lambda: _reclaimed(nc), 15, "KV back to full on both shards")


@pytest.mark.services
@pytest.mark.parametrize("codec", ["fp8", "int4-delta"])
async def test_codec_prefill_and_decode_shards_move_codes_and_scales(
    toy_checkpoint: Path, tmp_path: Path, oracle, codec: str
) -> None:
    """Every process under ``--kv-cache-dtype`` fp8 or int4-delta: the decode worker pulls
    codes and scales (exactly the codec's bytes for the prompts' blocks, every plane and
    layer; under int4-delta the full blocks only, and a prompt under one block prefills on
    the decode shard) and every request, finished on the decode shard, equals the oracle
    under the same codec, tokens and exit depths."""
    args = [*ENGINE_ARGS, "--kv-cache-dtype", codec]
    config = engine_config_from(args)
    assert config.kv_cache_dtype == codec
    with nats_server_and_procs(toy_checkpoint, tmp_path, args) as (server, procs):
        async with client(server.url) as nc:
            await _up(procs, nc)
            cases = make_cases(51, 6, max_tokens=10)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"{codec}-{i}", ids, p))
            await col.wait_done(list(range(len(cases))), 120)
            compared = 0
            for i, (ids, p) in enumerate(cases):
                final = check_stream(col.events[i])
                assert isinstance(final, FinishedEvent) and final.shard == "1", final
                want = oracle_result(oracle, ids, p.resolve(4, 512), config)
                compared += assert_matches_oracle(final, want, f"{codec}-{i}")
            assert compared == len(cases) * 10
            decode = await _shard_health(nc, "scheduler", "1")
            worker = await _shard_health(nc, "worker", "1")
            bs = config.block_size
            if codec == "fp8":
                blocks = [-(-len(ids) // bs) for ids, _ in cases]
            else:
                blocks = [len(ids) // bs for ids, _ in cases]
                assert 0 in blocks and any(len(ids) % bs for ids, _ in cases)
            pulled = sum(1 for b in blocks if b)
            assert decode["kv_pulled"] == pulled and decode["kv_pull_failures"] == 0
            cfg = toy_config("toy")
            per_block = (
                cfg.num_hidden_layers
                * cfg.total_ut_steps
                * block_bytes(codec, bs, cfg.num_key_value_heads, cfg.head_dim, 4)
            )
            assert worker["kv_bytes_pulled"] == sum(blocks) * per_block  # codes and scales
            await wait_for(lambda: _reclaimed(nc), 15, "KV back to full on both shards")


@pytest.mark.services
async def test_lost_pull_results_are_sent_again_until_acknowledged(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """The decode worker loses its first three publications of pull results on the way
    (``RLT_KV_RESULTS_TEST_DROP``): it publishes them again until its scheduler
    acknowledges them, so every request still decodes from its pulled KV, equal to the
    engine, and no block stays out of use on either shard."""
    envs = {"worker-1": {"RLT_KV_RESULTS_TEST_DROP": "3"}}
    with nats_server_and_procs(toy_checkpoint, tmp_path) as (server, procs):
        async with client(server.url) as nc:
            await _up(procs, nc, envs=envs)
            cases = make_cases(48, 4, max_tokens=10)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"ack-{i}", ids, p))
            await col.wait_done(list(range(len(cases))), 60)
            check_against_engine(col, cases, toy_checkpoint)
            worker = await _shard_health(nc, "worker", "1")
            decode = await _shard_health(nc, "scheduler", "1")
            assert worker["kv_results_resent"] >= 3, worker
            assert worker["kv_results_unconfirmed"] == 0, worker
            assert worker["kv_results_confirmed"] == len(cases), worker
            assert decode["kv_pulled"] == len(cases) and decode["kv_pull_failures"] == 0, decode
            assert decode["kv_blocks_quarantined"] == 0, decode
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


# the decode worker holds each pull this long after each of its chunks (tests only), in
# chunks of 4 KiB (a toy prompt's KV is 8-32 KiB): a pull is under way for seconds
HOLD = {"RLT_KV_TRANSFER_TEST_HOLD_S": "0.5", "RLT_KV_TRANSFER_CHUNK_BYTES": "4096"}


async def _landing(nc) -> bool:  # type: ignore[no-untyped-def]
    """A pull of the decode worker has landed a chunk and is not over."""
    return (await _shard_health(nc, "worker", "1"))["kv_pulls_landing"] >= 1


@pytest.mark.slow  # ~20 s: a worker killed, its requests prefilled again
async def test_a_prefill_worker_killed_during_a_pull(toy_checkpoint: Path, tmp_path: Path) -> None:
    with nats_server_and_procs(toy_checkpoint, tmp_path) as (server, procs):
        async with client(server.url) as nc:
            await _up(procs, nc, envs={"worker-1": HOLD})
            cases = make_cases(46, 3, max_tokens=16)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"mid-{i}", ids, p))
            await wait_for(lambda: _handed_off(nc, 3), 30, "three requests handed over")
            await wait_for(lambda: _landing(nc), 30, "a pull under way")
            procs.kill("worker-0")  # kill -9, mid-pull: the rest of its chunks cannot be read
            await col.wait_done([0, 1, 2], 90)
            check_against_engine(col, cases, toy_checkpoint)
            worker = await _shard_health(nc, "worker", "1")
            decode = await _shard_health(nc, "scheduler", "1")
            assert worker["kv_pull_failures_by_cause"].get("source_lost", 0) >= 1, worker
            assert decode["kv_pull_failures"] >= 1 and decode["kv_pulled"] < 3, decode
            await wait_for(lambda: _reclaimed(nc), 20, "KV back to full on both shards")


@pytest.mark.slow  # ~25 s: a stalled worker's loss and return
async def test_a_pull_from_a_stalled_source_times_out(toy_checkpoint: Path, tmp_path: Path) -> None:
    """Over TCP (a stopped process still serves UCX's shared-memory copies), the source
    worker is stopped (SIGSTOP) between two chunks of a pull: the chunk in flight never
    completes, the pull is aborted at its deadline (RLT_KV_TRANSFER_TIMEOUT_S) and the
    decode shard prefills the prompt itself."""
    tcp = {"UCX_TLS": "tcp"}
    envs = {
        "worker-0": tcp,
        "worker-1": {**tcp, **HOLD, "RLT_KV_TRANSFER_TEST_HOLD_S": "0.8"},
        "scheduler-1": {"RLT_KV_TRANSFER_TIMEOUT_S": "2.5"},
    }
    with nats_server_and_procs(toy_checkpoint, tmp_path) as (server, procs):
        async with client(server.url) as nc:
            await _up(procs, nc, envs=envs)
            cases = make_cases(47, 2, max_tokens=16)
            col = await StreamCollector(nc).start()
            for i, (ids, p) in enumerate(cases):
                await col.send(i, as_request(f"stall-{i}", ids, p))
            await wait_for(lambda: _handed_off(nc, 2), 30, "two requests handed over")
            await wait_for(lambda: _landing(nc), 30, "a pull under way")
            procs.kill("worker-0", signal.SIGSTOP)
            try:
                await col.wait_done([0, 1], 90)
            finally:
                procs.kill("worker-0", signal.SIGCONT)
            check_against_engine(col, cases, toy_checkpoint)
            worker = await _shard_health(nc, "worker", "1")
            assert worker["kv_pull_failures_by_cause"].get("timeout", 0) >= 1, worker
            assert worker["kv_pulls_active"] == 0
            await wait_for(lambda: _healthy(nc, {"0", "1"}), 30, "both shards back")
            await wait_for(lambda: _reclaimed(nc), 20, "KV back to full on both shards")


async def _handed_off(nc, n: int) -> bool:  # type: ignore[no-untyped-def]
    return (await _shard_health(nc, "scheduler", "0"))["handed_off"] >= n


class nats_server_and_procs:
    def __init__(
        self, checkpoint: Path, workdir: Path, engine_args: list[str] = PREFIX_ARGS
    ) -> None:
        from services.launcher import NatsServer, free_port

        self._server = NatsServer(port=free_port())
        self._checkpoint, self._workdir = checkpoint, workdir
        self._engine_args = engine_args
        self._procs = None

    def __enter__(self):  # type: ignore[no-untyped-def]
        server = self._server.__enter__()
        self._procs = service_procs(
            server.url, self._checkpoint, self._workdir, self._engine_args, ENV
        )
        return server, self._procs.__enter__()

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        try:
            assert self._procs is not None
            self._procs.__exit__(*exc)
        finally:
            self._server.__exit__(*exc)


_ = asyncio  # the tests are coroutines (pytest-asyncio's auto mode)
