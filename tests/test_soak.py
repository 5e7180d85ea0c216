"""Bounded soak (about half a minute; ``scripts/soak.py`` runs the long one): 4 clients with
4 requests in flight each, random aborts and malformed messages, against the services as
real processes. Every request ends exactly once, KV is fully reclaimed, RSS stays flat."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.soak import ENGINE_ARGS, run_adversary_soak, run_soak
from services.launcher import NatsServer, free_port
from tests.service_procs import service_procs

pytestmark = pytest.mark.slow

SOAK_SECONDS = 30.0
# generous: a leak shows as steady growth over a long run (scripts/soak.py); this catches gross ones
MAX_RSS_GROWTH_MIB = 48.0


async def test_soak_every_request_ends_once_kv_reclaimed_rss_flat(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS) as procs,
    ):
        await procs.start_all()
        report = await run_soak(server.url, procs, duration_s=SOAK_SECONDS, clients=4, seed=1)
    print(f"\nsoak: {report}")
    assert report.requests > 100 and report.malformed > 5 and report.aborts > 10, report
    assert report.missing == 0 and report.duplicates == 0, report
    assert report.wrong_malformed == 0, report
    assert report.kv_reclaimed and report.open_requests_left == 0, report
    assert "abort" in report.finished and "length" in report.finished, report
    assert not any(k.startswith("error:") for k in report.finished), report
    for key, growth in report.rss_growth_mib.items():
        assert growth < MAX_RSS_GROWTH_MIB, (key, report.rss_growth_mib)


ADVERSARY_SECONDS = 15.0


async def test_soak_with_an_adversary_no_honest_request_lost_or_altered(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """NATS secured as `rlt up` secures it; 3 honest clients (the default tenant) and an
    attacker tenant that knows their request ids and inboxes and tries everything a client
    can (scripts/soak.py, run_adversary): every honest request ends once with the engine's
    output, the attacker gets exactly its refusals and never anything of anyone else's."""
    report = await run_adversary_soak(
        toy_checkpoint, tmp_path, duration_s=ADVERSARY_SECONDS, clients=3, seed=2
    )
    print(f"\nadversary soak: {report}")
    assert report.requests > 100 and report.adversary_probes > 100, report
    assert report.missing == 0 and report.duplicates == 0, report
    assert report.verified == report.requests, report
    # outputs that differ from the engine's only at a near-tie are counted apart and named
    assert report.altered == 0, report.divergences
    assert all(d["near_tie"] for d in report.divergences), report.divergences
    assert not any(k.startswith("error:") for k in report.finished), report
    assert report.adversary_wrong == 0 and report.adversary_leaks == 0, report
    assert report.adversary_denied > 10, report  # NATS itself refused its forgeries
    assert report.kv_reclaimed and report.open_requests_left == 0, report
