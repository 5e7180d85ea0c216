"""A prefill worker's KV arena that left NIXL (its runner replaced by a new epoch) may still
be read by a peer: over TCP, UCX serves that READ in the source process by copying from the
arena's address, registered or not. Freed, the copy kills the process; kept a while
(``RetiredArenas``), the read is served (stale data, which the handoff's release says is
not held) and the process lives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.worker.kv_transfer.agent import KVArena, nixl_available
from services.worker.kv_transfer.retired import RetiredArenas

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import gc, sys, torch
from services.worker.kv_transfer.agent import KVArena, KVTransferAgent
from services.worker.kv_transfer.retired import RetiredArenas

def arena():
    return KVArena(torch.ones(2, 64, 16, 4, 64), torch.ones(2, 64, 16, 4, 64))

source, peer = KVTransferAgent("retired-src"), KVTransferAgent("retired-dst")
kv = arena()
layout = kv.layout("last_exited", 1)
source.register(kv, "e1", layout)
peer.register(arena(), "e1", layout)
info = source.source_info()
peer.read(info, list(range(8)), list(range(8)), 5.0)
source.deregister()  # the runner is replaced: its KV leaves NIXL
retired = RetiredArenas()
if sys.argv[1] == "retired":
    retired.keep(kv, 0.0)
del kv
gc.collect()
moved = peer.read(info, list(range(8)), list(range(8)), 5.0)  # a late pull of the old epoch
print("alive", moved, flush=True)
"""


def _probe(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.services
@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_a_late_read_of_a_retired_arena_kills_the_source_unless_it_is_kept() -> None:
    freed = _probe("freed")
    assert freed.returncode != 0 and "alive" not in freed.stdout  # what the soak hit
    kept = _probe("retired")
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert "alive 524288" in kept.stdout


def _arena(device: str = "cpu") -> KVArena:
    return KVArena(torch.zeros(1, 2, 2, 1, 2, device=device), torch.zeros(1, 2, 2, 1, 2))


@pytest.mark.unit
def test_host_arenas_are_held_for_their_time_and_bounded() -> None:
    retired = RetiredArenas(hold_s=10.0, max_arenas=2)
    retired.keep(_arena(), now=0.0)
    retired.keep(_arena(), now=1.0)
    assert len(retired) == 2
    retired.keep(_arena(), now=2.0)
    assert len(retired) == 2 and retired.num_dropped_early == 1
    retired.expire(10.5)  # the one of t=1 stays until 11
    assert len(retired) == 2
    retired.expire(11.0)
    assert len(retired) == 1
    retired.expire(12.0)
    assert len(retired) == 0


@pytest.mark.unit
def test_device_arenas_are_not_held() -> None:
    retired = RetiredArenas()
    arena = _arena("meta")
    assert arena.mem_type == "VRAM"
    retired.keep(arena, now=0.0)
    assert len(retired) == 0
