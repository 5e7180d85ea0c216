"""Bounded P/D fault soak (``scripts/soak_disaggregated.py`` runs the long one): a prefill
and a decode shard as real processes, their workers killed (kill -9) or stopped (SIGSTOP)
while pulls are under way; every request ends once, every finished output equals the
in-process engine's, and once idle every block is free on both shards
(``rlt:kv_cache_usage_perc`` back to 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.soak_disaggregated import ENGINE_ARGS, _both_healthy, run_pd_soak, start_pd
from services.launcher import NatsServer, free_port
from services.launcher.probes import client
from services.worker.kv_transfer.agent import nixl_available
from tests.service_procs import service_procs, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

SOAK_SECONDS = 8.0


async def test_pd_soak_faults_during_pulls_every_stream_exact_every_block_free(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS) as procs,
    ):
        await start_pd(procs, decode_blocks=256)
        async with client(server.url) as nc:
            await wait_for(lambda: _both_healthy(nc), 60, "both shards healthy")
        report = await run_pd_soak(
            server.url,
            procs,
            toy_checkpoint,
            duration_s=SOAK_SECONDS,
            clients=3,
            concurrency=3,
            fault_every_s=2.5,
            seed=3,
        )
    print(f"\nP/D soak: {report}")
    # 8 s hold one or two faults (each waits for both shards healthy again): at least one,
    # landed during a pull
    assert report.requests > 30 and report.faults_mid_pull >= 1, report
    assert report.missing == 0 and report.duplicates == 0 and report.inconsistent == 0, report
    assert report.verified > 0 and report.verified_tokens > 0, report
    assert report.altered == 0, report.divergences
    assert report.finished_on_shard.get("1", 0) > 0, report  # pulled and decoded there
    assert report.kv_reclaimed and report.kv_usage_at_end == {"0": 0.0, "1": 0.0}, report
