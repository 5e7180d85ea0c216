"""Depth shedding over NATS: the scheduler service sheds under a long queue, the budget
reaches the worker service per row, ``shed_depth: false`` travels through admission, and
every token equals the serial oracle run with the budget the finished event records."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import structlog

from messages.api import FinishedEvent, GenerateRequest
from services.cli import main
from services.common.config import SchedulerConfig
from services.launcher import NatsServer
from services.oracle import SerialOracle

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402
from tests.engine_harness import assert_matches_oracle  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]
pytestmark = [pytest.mark.services, pytest.mark.usefixtures("torch_single_thread")]

MAX_TOKENS = 12


async def test_shedding_over_nats_matches_the_oracle_with_each_tokens_budget(
    nats_server: NatsServer, toy_checkpoint: Path, oracle: SerialOracle, run_dir: Path
) -> None:
    config = SchedulerConfig(
        max_num_seqs=2,
        block_size=4,
        num_blocks=512,
        prefill_chunk_size=4,
        max_num_batched_tokens=16,
        overload_policy="shed-depth",  # type: ignore[arg-type]
    )
    rng = random.Random(17)
    requests = [
        GenerateRequest(
            request_id=f"shed-{i}",
            prompt_token_ids=[rng.randrange(1, 400) for _ in range(rng.randrange(3, 12))],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            min_loops=1 if i % 2 else 2,
            exit_threshold=0.7 if i % 3 == 1 else None,
            shed_depth=i != 5,
        )
        for i in range(10)
    ]
    async with (
        services_up(nats_server.url, toy_checkpoint, config) as services,
        Client.connect(nats_server.url) as client,
    ):
        streams = await asyncio.gather(*(client.generate(r, timeout=60.0) for r in requests))
        scheduler = services["scheduler"].driver.scheduler  # type: ignore[attr-defined]
        assert scheduler.stats.num_shed_tokens > 0
        assert scheduler.kv.num_free_blocks == config.num_blocks
    shed = compared = 0
    for req, events in zip(requests, streams, strict=True):
        finished = check_stream(events)
        assert isinstance(finished, FinishedEvent), finished
        if not req.shed_depth:
            assert finished.shed_tokens == 0 and finished.depth_budgets is None
        shed += finished.shed_tokens
        expected = oracle.generate(
            req.prompt_token_ids or [],
            max_tokens=MAX_TOKENS,
            min_loops=req.min_loops,
            exit_threshold=req.exit_threshold,
            ignore_eos=True,
            max_loops_per_token=finished.depth_budgets,
        )
        compared += assert_matches_oracle(finished, expected, label=req.request_id or "")
    assert shed > 0 and compared > 0


def test_quick_overload_bench_reports_both_policies(toy_checkpoint: Path, tmp_path: Path) -> None:
    """``rlt bench --only overload``: every (device, load, arm) ran, the targets are judged,
    and the report and plot are written."""
    saved = structlog.get_config()  # main_bench quiets structlog: give it back
    try:
        argv = ["bench", "--quick", "--checkpoint", str(toy_checkpoint), "--only", "overload"]
        assert main([*argv, "--repeats", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    finally:
        structlog.configure(**saved)
    results = json.loads((tmp_path / "results.json").read_text())
    (comp,) = results["comparisons"]
    seen = {(r["device"], r["load"], r["arm"]) for r in comp["runs"]}
    assert len(seen) == 2 * 4 * 2 == len(comp["runs"])
    assert all(
        r["metrics"]["finished"] + round(r["metrics"]["refused_fraction"] * r["metrics"]["offered"])
        == r["metrics"]["offered"]
        for r in comp["runs"]
    )
    assert all(
        r["metrics"]["mean_loops_per_token"] == 4 for r in comp["runs"] if r["arm"] == "reject"
    )
    judged = [t for t in results["targets"] if t["comparison"] == "overload"]
    assert len(judged) == 4 and all(t["reached"] in (True, False) for t in judged)
    report = (tmp_path / "report.md").read_text()
    assert "## Overload" in report and (tmp_path / "overload.png").exists()
