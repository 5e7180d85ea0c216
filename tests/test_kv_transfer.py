"""The NIXL transfer module alone: block runs into descriptors, byte-exact READs between two
agents, a layout mismatch refused by name, a dead peer and a stalled one (a transfer that
times out) reported by cause without hanging; shards of different block formats refused
by admission, by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from messages.internal import ShardAnnounce
from messages.kv_transfer import KVBlockFormat, KVSourceInfo
from services.admission.shards import ShardTable
from services.common.service_flags import shard_roles
from services.worker.kv_transfer import agent as kvt
from services.worker.kv_transfer.agent import KVArena, KVTransferAgent, TransferError, block_runs

needs_nixl = pytest.mark.skipif(not kvt.nixl_available(), reason="NIXL is not installed")


def _arena(blocks: int, fill: bool, layers: int = 3) -> KVArena:
    shape = (layers, blocks, 4, 2, 8)
    make = torch.randn if fill else torch.zeros
    return KVArena(make(shape), make(shape))


@pytest.mark.unit
def test_block_runs_pair_consecutive_blocks_on_both_sides() -> None:
    assert block_runs([3, 4, 5, 9, 1], [10, 11, 12, 0, 29]) == [(3, 10, 3), (9, 0, 1), (1, 29, 1)]
    assert block_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    with pytest.raises(ValueError):
        block_runs([1], [])


@pytest.mark.unit
def test_roles_and_shard_counts() -> None:
    assert shard_roles(3) == ("both",) * 3
    assert shard_roles(1, 2, 1) == ("prefill", "prefill", "decode")
    with pytest.raises(ValueError):
        shard_roles(1, 1, 0)
    with pytest.raises(ValueError):
        shard_roles(2, 1, 1)


@pytest.mark.unit
def test_a_shard_with_another_block_format_is_refused_by_name() -> None:
    table = ShardTable("adm", block_size=16)
    fmt = KVBlockFormat(kv_layout="last_exited", block_size=16, num_planes=4)
    ok = ShardAnnounce(shard_id="0", scheduler_id="s0", block_size=16, role="prefill",
                       block_format=fmt)  # fmt: skip
    assert table.announce(ok, 0.0) == (None, None)
    other = KVBlockFormat(kv_layout="shared", block_size=16, num_planes=1)
    bad = ShardAnnounce(shard_id="1", scheduler_id="s1", block_size=16, role="decode",
                        block_format=other)  # fmt: skip
    why, _ = table.announce(bad, 0.0)
    assert why is not None and "kv_layout: shared vs last_exited" in why and "shard 0" in why
    colocated = ShardAnnounce(shard_id="2", scheduler_id="s2", block_size=16)
    assert table.announce(colocated, 0.0) == (None, None)  # both roles: never handed over


@pytest.mark.unit
@needs_nixl
def test_reads_are_byte_exact_and_a_layout_mismatch_is_refused() -> None:
    src, dst = _arena(20, True), _arena(30, False)
    a, b = KVTransferAgent("unit-a"), KVTransferAgent("unit-b")
    a.register(src, "e1", src.layout("last_exited", 4))
    b.register(dst, "e2", dst.layout("last_exited", 4))
    remote, local = [3, 4, 5, 9, 1], [10, 11, 12, 0, 29]
    moved = b.read(a.source_info(), remote, local, 5.0)
    assert moved == 2 * 3 * len(remote) * src.block_bytes
    for r, m in zip(remote, local, strict=True):
        assert torch.equal(dst.k[:, m], src.k[:, r]) and torch.equal(dst.v[:, m], src.v[:, r])
    assert not dst.k[:, 5].any()  # nothing else written
    other = _arena(20, True, layers=2)
    c = KVTransferAgent("unit-c")
    c.register(other, "e3", other.layout("last_exited", 4))
    with pytest.raises(TransferError) as err:
        b.read(c.source_info(), [0], [0], 5.0)
    assert err.value.cause == kvt.LAYOUT_MISMATCH and "num_layers: 3 vs 2" in str(err.value)


_PEER = textwrap.dedent(
    """
    import sys, time, torch
    from services.worker.kv_transfer.agent import KVArena, KVTransferAgent
    from services.runtime.bus import encode_msgpack
    shape = (3, 64, 16, 8, 64)
    arena = KVArena(torch.ones(shape), torch.ones(shape))
    agent = KVTransferAgent("unit-peer")
    agent.register(arena, "e", arena.layout("last_exited", 4))
    open(sys.argv[1], "wb").write(encode_msgpack(agent.source_info()))
    time.sleep(60)
    """
)


@pytest.mark.slow  # a peer process (torch, NIXL): 15-25 s each on two busy cores
@needs_nixl
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_dead_or_stalled_peer_fails_the_pull_by_cause_within_its_deadline(
    tmp_path: Path, fault: str
) -> None:
    from services.runtime.bus import decode_msgpack

    info_path = tmp_path / "info"
    # over TCP: a stopped process cannot serve a read (shared-memory copies would still work)
    env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(Path.cwd())}
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(info_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not info_path.exists() or not info_path.stat().st_size:
            assert peer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        info = decode_msgpack(info_path.read_bytes(), KVSourceInfo)
        os.environ["UCX_TLS"] = "tcp"  # this process's new agent too
        try:
            dst = KVArena(torch.zeros(3, 64, 16, 8, 64), torch.zeros(3, 64, 16, 8, 64))
            agent = KVTransferAgent(f"unit-reader-{fault}")
            agent.register(dst, "e", dst.layout("last_exited", 4))
        finally:
            del os.environ["UCX_TLS"]
        blocks = list(range(64))
        assert agent.read(info, blocks, blocks, 10.0) > 0  # the peer serves
        assert dst.k.all()
        peer.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        if fault == "killed":
            peer.wait()
        started = time.monotonic()
        with pytest.raises(TransferError) as err:
            for _ in range(20):  # the first may still find the socket's buffers
                agent.read(info, blocks, blocks, 1.0)
        took = time.monotonic() - started
        want = kvt.SOURCE_LOST if fault == "killed" else kvt.TIMEOUT
        assert err.value.cause == want, err.value
        assert took < 15.0
    finally:
        peer.send_signal(signal.SIGCONT)
        peer.kill()
        peer.wait()
