"""Engine settings, workloads and checks shared by the services tests (real processes on a
real nats-server): what they send and how they compare the answers with the engine and the
oracle."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from messages.api import FinishedEvent, GenerateRequest
from messages.sampling import SamplingParams
from services.cli import build_parser
from services.common.flags import scheduler_config_from_args
from services.engine.engine import LLMEngine
from services.oracle import SerialOracle

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.service_procs import StreamCollector, health  # noqa: E402

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


def engine_config():  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["service", "worker", *ENGINE_ARGS])
    return scheduler_config_from_args(args)


def make_cases(seed: int, n: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
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


def as_request(rid: str, ids: list[int], p: SamplingParams) -> GenerateRequest:
    """The NATS API request for prompt ``ids`` with the sampling ``p``."""
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        seed=p.seed,
        min_loops=p.min_loops,
        max_loops=p.max_loops,
        exit_threshold=p.exit_threshold,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
    )


def check_against_engine(
    col: StreamCollector,
    cases: list[tuple[list[int], SamplingParams]],
    checkpoint: Path,
    oracle: SerialOracle | None = None,
    *,
    whole_streams: bool = True,
) -> None:
    expected = LLMEngine.from_checkpoint(checkpoint, engine_config()).generate(
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


async def kv_reclaimed(nc) -> bool:  # type: ignore[no-untyped-def]
    h = await health(nc, "scheduler")
    return h["live_requests"] == 0 and h["free_kv_blocks"] == h["num_kv_blocks"]


PREFIX_ARGS = [*ENGINE_ARGS, "--enable-prefix-caching"]


def prefix_prompt(i: int) -> list[int]:
    # 4-token blocks: each prompt caches a few blocks of its own and shares one with others
    return [1, 2, 3, 4, *[(7 * i + k) % 500 + 1 for k in range(14)]]


async def index_matches_scheduler(nc: Any) -> bool:
    """The prefix index's view of the scheduler equals the scheduler's own block table."""
    try:
        sched = await health(nc, "scheduler")
        index = await health(nc, "prefix-cache")
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return False  # a service still failing over to another node
    producer = sched["prefix_producer"]
    return index["digests"].get(producer, "") == sched["prefix_digest"] or (
        sched["prefix_blocks"] == 0 and producer not in index["digests"]
    )
