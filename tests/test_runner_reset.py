"""A worker's runner rebuilt at a KV reset (a new epoch or geometry) frees the old runner's KV
before it allocates its own: on a GPU the KV takes most of the memory, so two at once do not
fit. Two things held the old one: the runner and its static decode passes refer to each other
(only the cyclic garbage collector would free them), and the KV transfer agent keeps the
arenas it registered for peers (until the next batch registered the new ones)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.worker import runner_host
from services.worker.kv_transfer import agent as kvt
from services.worker.kv_transfer.pulls import KVPulls
from services.worker.kv_transfer.retired import RetiredArenas
from services.worker.runner_host import RunnerHost

pytestmark = pytest.mark.unit


def _watch_reset(host: RunnerHost, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the current runner's K cache was gone when each later runner was built."""
    old = weakref.ref(host.runner.k_cache)  # type: ignore[union-attr]
    seen: list[bool] = []
    build = runner_host.ModelRunner

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(old() is None)
        return build(*args, **kwargs)

    monkeypatch.setattr(runner_host, "ModelRunner", spy)
    return seen


def _reset_without_gc(host: RunnerHost) -> None:
    gc.collect()
    gc.disable()  # deterministic: only what frees itself counts
    try:
        host.make_runner(16, 4, "shared")
    finally:
        gc.enable()


def test_a_runner_with_static_passes_is_freed_before_the_next_is_built(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLT_DECODE_MODE", "padded")  # what a GPU runs, less the graphs
    host = RunnerHost(toy_checkpoint, "cpu", torch.float32)
    host.load()
    host.make_runner(16, 4, "shared")
    assert host.runner is not None and host.runner.static is not None  # type: ignore[union-attr]
    seen = _watch_reset(host, monkeypatch)
    _reset_without_gc(host)
    assert seen == [True]


@pytest.mark.skipif(not kvt.nixl_available(), reason="NIXL is not installed")
def test_the_kv_registered_for_peers_is_let_go_before_the_next_runner_is_built(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLT_DECODE_MODE", "eager")
    host = RunnerHost(toy_checkpoint, "cpu", torch.float32)
    host.load()

    async def fetch(_worker: str, _timeout: float) -> None:
        return None

    async def scenario() -> list[bool]:
        pulls = KVPulls("reset-test", host.total_loops, fetch, CollectorRegistry(), _Log())
        # device KV is never held once retired (a host arena is, for late peer reads:
        # tests/test_kv_retired_arenas.py); this CPU run stands for a GPU's
        pulls.retired = RetiredArenas(hold_s=0.0)
        await pulls.start()
        try:
            host.before_replace = pulls.retire
            host.make_runner(16, 4, "shared")
            pulls.before_batch(host.runner, "epoch-1", "shared", [])  # offered to peers
            info = await pulls.source_info()
            assert not info.error and info.num_blocks == 17
            seen = _watch_reset(host, monkeypatch)
            _reset_without_gc(host)
            return seen
        finally:
            await asyncio.to_thread(pulls.close)

    assert asyncio.run(scenario()) == [True]


class _Log:
    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: None
