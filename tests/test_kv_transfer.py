"""The NIXL transfer module alone: block runs into descriptors, byte-exact READs between two
agents, a layout mismatch refused by name, a dead peer and a stalled one (a transfer that
times out) reported by cause without hanging; shards of different block formats refused
by admission, by name."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry

from kernels.kv_codec import bytes_per_token
from messages.internal import ShardAnnounce
from messages.kv_transfer import KVBlockFormat, KVPull, KVSourceInfo
from services.admission.shards import ShardTable
from services.common.service_flags import shard_roles
from services.worker.kv_cache import PagedKV
from services.worker.kv_int4.paged import Int4KV
from services.worker.kv_transfer import agent as kvt
from services.worker.kv_transfer.agent import (
    KVArena,
    KVTransferAgent,
    TransferError,
    block_indices,
    block_table,
)
from services.worker.kv_transfer.pulls import KVPulls

needs_nixl = pytest.mark.skipif(not kvt.nixl_available(), reason="NIXL is not installed")


def _arena(blocks: int, fill: bool, layers: int = 3) -> KVArena:
    shape = (layers, blocks, 4, 2, 8)
    make = torch.randn if fill else torch.zeros
    return KVArena(make(shape), make(shape))


@pytest.mark.unit
def test_prepared_descriptors_index_each_block_of_each_layer_of_each_arena() -> None:
    """One descriptor per (arena, layer, block), prepared once; a pull's indices into the
    local and the remote table pair block for block in the same (arena, layer) order."""
    table = block_table([1000, 90000], num_blocks=5, num_layers=3, block_bytes=10, device_id=2)
    assert table.shape == (2 * 3 * 5, 3)
    assert table[(1 * 3 + 2) * 5 + 4].tolist() == [90000 + 2 * 5 * 10 + 4 * 10, 10, 2]
    local = block_indices([4, 0], num_arenas=2, num_layers=3, num_blocks=5)
    remote = block_indices([1, 3], num_arenas=2, num_layers=3, num_blocks=7)
    assert local.tolist() == [4, 0, 9, 5, 14, 10, 19, 15, 24, 20, 29, 25]
    assert remote.tolist()[:4] == [1, 3, 8, 10] and len(remote) == len(local)


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


@pytest.mark.unit
@needs_nixl
def test_the_sources_device_id_travels_with_it_and_names_its_descriptors() -> None:
    """A source's arenas need not sit on device 0: its description carries the device and
    the source's prepared descriptors name it (prepared once per source)."""
    src, dst = _arena(8, True), _arena(8, False)
    a, b = KVTransferAgent("unit-dev-a"), KVTransferAgent("unit-dev-b")
    a.register(src, "e1", src.layout("last_exited", 4))
    b.register(dst, "e2", dst.layout("last_exited", 4))
    info = a.source_info()
    assert info.device_id == src.device_id == 0
    prepared: list[tuple[str, object]] = []
    prep = b._agent.prep_xfer_dlist

    def recorded(agent_name, table, mem_type):  # type: ignore[no-untyped-def]
        prepared.append((agent_name, table))
        return prep(agent_name, table, mem_type)

    b._agent.prep_xfer_dlist = recorded
    b.plan(info, [1, 2, 5], [0, 1, 6])
    b.plan(info, [4], [7])  # prepared once per source
    ((name, table),) = prepared
    assert name == "unit-dev-a" and set(table[:, 2].tolist()) == {info.device_id}
    # a device the source did not register is refused by NIXL, not read from device 0
    with pytest.raises(TransferError):
        b.plan(msgspec.structs.replace(info, device_id=3), [1], [0])
    assert set(prepared[-1][1][:, 2].tolist()) == {3}


@pytest.mark.unit
@needs_nixl
def test_a_failed_registration_is_reported_to_peers_by_cause() -> None:
    """NIXL refusing the arena is not dropped: ``register`` raises it by cause, and a peer
    asking for this worker's KV is told why (its pulls fail as ``registration_failed``)."""
    agent = KVTransferAgent("unit-reg")
    arena = _arena(4, False)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("NIXL_ERR_BACKEND")

    agent._agent.register_memory = refuse  # NIXL's own call fails
    with pytest.raises(TransferError) as err:
        agent.register(arena, "e1", arena.layout("last_exited", 4))
    assert err.value.cause == kvt.REGISTRATION_FAILED
    info = agent.source_info()
    assert info.error_cause == kvt.REGISTRATION_FAILED and "NIXL_ERR_BACKEND" in info.error


@pytest.mark.unit
def test_descriptors_of_arenas_of_different_block_bytes() -> None:
    """fp8's scale arenas have blocks of their own size: each arena's descriptors use it."""
    table = block_table([1000, 5000, 90000], num_blocks=4, num_layers=2, block_bytes=[32, 32, 8],
                        device_id=0)  # fmt: skip
    scales = table[2 * 2 * 4 :]
    assert scales[:, 1].tolist() == [8] * 8
    assert scales[1 * 4 + 3].tolist() == [90000 + 1 * 4 * 8 + 3 * 8, 8, 0]
    assert table[(1 * 2 + 1) * 4 + 2].tolist() == [5000 + 4 * 32 + 2 * 32, 32, 0]


@pytest.mark.unit
def test_a_shard_of_another_codec_is_refused_by_name() -> None:
    table = ShardTable("adm", block_size=16)
    fmt = KVBlockFormat(kv_layout="last_exited", block_size=16, num_planes=4)
    ok = ShardAnnounce(shard_id="0", scheduler_id="s0", block_size=16, role="prefill",
                       block_format=fmt)  # fmt: skip
    assert table.announce(ok, 0.0) == (None, None)
    fp8 = msgspec.structs.replace(fmt, kv_cache_dtype="fp8")
    bad = ShardAnnounce(shard_id="1", scheduler_id="s1", block_size=16, role="decode",
                        block_format=fp8)  # fmt: skip
    why, _ = table.announce(bad, 0.0)
    assert why is not None and "kv_cache_dtype: fp8 vs auto" in why and "--kv-cache-dtype" in why


class _Runner:
    def __init__(self, kv: PagedKV | Int4KV) -> None:
        self.kv = kv


def _empty(codec: str, geometry: tuple[int, ...]) -> PagedKV | Int4KV:
    cpu = torch.device("cpu")
    if codec == "int4-delta":
        return Int4KV(*geometry, dtype=torch.bfloat16, device=cpu, planes=4)
    return PagedKV(codec, *geometry, dtype=torch.bfloat16, device=cpu)


def _filled(codec: str, geometry: tuple[int, ...]) -> PagedKV | Int4KV:
    kv = _empty(codec, geometry)
    for t in kvt.KVArena.of(kv).tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape))
    return kv


async def _pull_through_the_worker(codec: str, geometry: tuple[int, ...]) -> tuple[float, bool]:
    """One pull through a decode worker's own path (``KVPulls``: its transfer thread, its
    metrics): (``rlt:kv_transfer_bytes_total``, whether every tensor landed byte-exact)."""
    src_kv, dst_kv = _filled(codec, geometry), _empty(codec, geometry)
    source = KVTransferAgent(f"unit-pulls-src-{codec}")
    arena = kvt.KVArena.of(src_kv)
    source.register(arena, "e", arena.layout("last_exited", 4))

    async def fetch(worker_id: str, timeout: float) -> KVSourceInfo:
        return source.source_info()

    registry = CollectorRegistry()
    pulls = KVPulls(f"unit-pulls-dst-{codec}", 4, fetch, registry, structlog.get_logger())
    await pulls.start()
    remote, local = [1, 2, 3, 7], [0, 5, 6, 2]
    pull = KVPull(transfer_id="t", request_id="r", worker_id="w", worker_epoch="e",
                  remote_blocks=remote, local_blocks=local)  # fmt: skip
    pulls.prepare([pull])
    pulls.before_batch(_Runner(dst_kv), "d", "last_exited", [pull])
    _, result = await asyncio.wait_for(pulls.results.get(), 20.0)
    pulls.close()
    assert result.ok, result
    exact = all(
        torch.equal(d[:, m].view(torch.uint8), s[:, r].view(torch.uint8))
        for s, d in zip(arena.tensors, kvt.KVArena.of(dst_kv).tensors, strict=True)
        for r, m in zip(remote, local, strict=True)
    )
    moved = registry.get_sample_value("rlt:kv_transfer_bytes_total")
    assert moved is not None and moved == result.num_bytes
    return moved / (len(remote) * geometry[2]), exact


@pytest.mark.unit
@needs_nixl
def test_fp8_pulls_move_codes_and_scales_at_about_half_the_bytes() -> None:
    """Through the worker's pull path, an fp8 pull lands the source's codes and scales
    byte for byte, and the transfer counter per context token (one layer here) is fp8's
    share of auto's at Ouro-1.4B's heads in bfloat16: 264 / 512 = 0.516, at most 0.55."""
    geometry = (2, 9, 16, 16, 128)  # layers, blocks, block size, Ouro-1.4B's kv heads x dim
    per_token = {}
    for codec in ("auto", "fp8"):
        per_token[codec], exact = asyncio.run(_pull_through_the_worker(codec, geometry))
        assert exact, codec
        want = bytes_per_token(codec, 16, 128, planes=1, block_size=16, model_bytes=2, layers=2)
        assert per_token[codec] == want
    ratio = per_token["fp8"] / per_token["auto"]
    assert ratio == 264 / 512 and ratio <= 0.55


@pytest.mark.unit
@needs_nixl
def test_int4_pulls_move_sealed_codes_scales_and_flags_at_a_third_of_the_bytes() -> None:
    """Through the worker's pull path, an int4-delta pull lands every field of the source's
    blocks byte for byte (packed codes, K and V scales and zero points, ``stored`` flags),
    and the transfer counter per context token is int4-delta's share of auto's at
    Ouro-1.4B's heads in bfloat16 (bs 16: 0.328, at most 0.35)."""
    geometry = (2, 9, 16, 16, 128)
    per_token, exact = asyncio.run(_pull_through_the_worker("int4-delta", geometry))
    assert exact
    want = bytes_per_token("int4-delta", 16, 128, planes=1, block_size=16, layers=2)
    assert per_token == want
    auto = bytes_per_token("auto", 16, 128, planes=1, block_size=16, layers=2)
    assert round(per_token / auto, 3) == 0.328


@pytest.mark.unit
def test_a_simulated_workers_codec_arenas_are_codes_and_scales() -> None:
    """``--device sim`` with ``--role``: host arenas of Ouro-1.4B's heads under the codec,
    so a simulated P/D run moves fp8's bytes (264 of 512 per token, head and layer)."""
    from services.worker.runner_host import sim_arena

    auto, fp8 = sim_arena(8, 16), sim_arena(8, 16, "fp8")
    assert len(auto.tensors) == 2 and len(fp8.tensors) == 4
    assert fp8.layout("last_exited", 4).mismatch(auto.layout("last_exited", 4)) == (
        "kv_cache_dtype: fp8 vs auto"
    )
    assert sum(fp8.arena_block_bytes) / sum(auto.arena_block_bytes) == 264 / 512
    int4 = sim_arena(8, 16, "int4-delta", anchor_every=2)
    assert len(int4.tensors) == 7 and int4.layout("last_exited", 4).head_dim == 128
    assert int4.layout("last_exited", 4).mismatch(
        sim_arena(8, 16, "int4-delta", anchor_every=1).layout("last_exited", 4)
    ) == ("kv_int4_anchor_every: 2 vs 1")
    assert round(sum(int4.arena_block_bytes) / sum(auto.arena_block_bytes), 3) == 0.328


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
