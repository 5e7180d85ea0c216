"""The worker's KV storage per codec: what it allocates, what it refuses, what a slot copy
moves (services/worker/kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_codec import BatchLimits, block_bytes, open_blocks_bound
from services.common.config import SchedulerConfig
from services.common.fit import blocks_in_memory
from services.worker.kv_cache import PagedKV, bytes_per_block

pytestmark = pytest.mark.unit

SHAPE = (2, 5, 4, 2, 8)  # layers, blocks, block_size, kv_heads, head_dim


def test_paged_kv_leaves_int4_delta_to_its_own_storage() -> None:
    with pytest.raises(ValueError, match="services/worker/kv_int4"):
        PagedKV("int4-delta", *SHAPE, dtype=torch.float32, device=torch.device("cpu"))


def test_config_refuses_an_unknown_codec() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        SchedulerConfig(kv_cache_dtype="int8")
    assert SchedulerConfig().kv_cache_dtype == "auto"


def test_config_refuses_int4_delta_in_the_shared_layout() -> None:
    with pytest.raises(ValueError, match="int4-delta needs kv_layout=last_exited"):
        SchedulerConfig(kv_cache_dtype="int4-delta", kv_layout="shared", split_prefill=False)
    assert SchedulerConfig(kv_cache_dtype="int4-delta").kv_cache_dtype == "int4-delta"


@pytest.mark.parametrize("codec", ["auto", "fp8"])
def test_allocated_bytes_are_the_codec_block_bytes(codec: str) -> None:
    layers, blocks, bs, nkv, hd = SHAPE
    kv = PagedKV(codec, *SHAPE, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv.nbytes == blocks * bytes_per_block(codec, layers, bs, nkv, hd, 2)
    assert kv.nbytes == blocks * layers * block_bytes(codec, bs, nkv, hd, 2)


def test_fp8_slot_copy_moves_codes_and_scales() -> None:
    layers, blocks, bs = SHAPE[:3]
    kv = PagedKV("fp8", *SHAPE, dtype=torch.float32, device=torch.device("cpu"))
    assert kv.k.dtype == torch.uint8 and kv.k_scale is not None and kv.v_scale is not None
    g = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randint(0, 255, kv.k.shape, generator=g, dtype=torch.uint8))
    kv.v.copy_(torch.randint(0, 255, kv.v.shape, generator=g, dtype=torch.uint8))
    kv.k_scale.copy_(torch.rand(kv.k_scale.shape, generator=g))
    kv.v_scale.copy_(torch.rand(kv.v_scale.shape, generator=g))
    src = torch.tensor([1, 6, 9])
    dst = torch.tensor([13, 17, 2])
    mask = torch.tensor([True, False, True])
    before = [t.clone() for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)]
    kv.copy_slots(src, dst, mask)
    for old, new in zip(before, (kv.k, kv.v, kv.k_scale, kv.v_scale), strict=True):
        flat_old, flat_new = old.view(layers, blocks * bs, -1), new.view(layers, blocks * bs, -1)
        assert torch.equal(flat_new[:, 13], flat_old[:, 1])
        assert torch.equal(flat_new[:, 2], flat_old[:, 9])
        assert torch.equal(flat_new[:, 17], flat_old[:, 17])  # masked: untouched


def test_worker_memory_check_counts_codec_bytes(toy_checkpoint, monkeypatch) -> None:
    """One KV memory (RLT_WORKER_MAX_KV_BYTES) admits more blocks under fp8 (~1.94x at
    Ouro's heads of 128; less at the toy's small heads, where scales weigh more): the geometry
    check counts codes and scales, not the model dtype."""
    from services.worker.runner_host import RunnerHost

    # int4-delta's batches hold few blocks open here: its tail reserve is the share
    few_open = BatchLimits(max_num_seqs=1, max_num_batched_tokens=1)
    hosts = {
        codec: RunnerHost(
            toy_checkpoint, "cpu", torch.bfloat16, kv_cache_dtype=codec, batch_limits=few_open
        )
        for codec in ("auto", "fp8", "int4-delta")
    }
    for host in hosts.values():
        host.load()
    cfg = hosts["auto"].model.cfg
    shape = (cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim, 2)
    auto_block = bytes_per_block("auto", *shape)
    memory = 100 * auto_block
    monkeypatch.setenv("RLT_WORKER_MAX_KV_BYTES", str(memory))
    hosts["auto"].check_geometry(100, 16, "last_exited")
    with pytest.raises(MemoryError):
        hosts["auto"].check_geometry(101, 16, "last_exited")
    fp8_fits = memory // bytes_per_block("fp8", *shape)
    assert fp8_fits >= 150
    hosts["fp8"].check_geometry(fp8_fits, 16, "last_exited")
    with pytest.raises(MemoryError):
        hosts["fp8"].check_geometry(fp8_fits + 1, 16, "last_exited")
    # int4-delta: codes, scales, flags and a full-precision tail per 32 block ids (the
    # check counts the scratch block too, hence one block less than fit's count)
    int4_fits = blocks_in_memory(memory, bytes_per_block("int4-delta", *shape), auto_block) - 1
    assert int4_fits > fp8_fits, (int4_fits, fp8_fits)  # the toy's small heads: scales weigh more
    planes = cfg.total_ut_steps
    assert open_blocks_bound(planes, 16, few_open) < -(-int4_fits // 32)
    hosts["int4-delta"].check_geometry(int4_fits, 16, "last_exited")
    with pytest.raises(MemoryError):
        hosts["int4-delta"].check_geometry(int4_fits + 2, 16, "last_exited")


def test_int4_geometry_check_reserves_the_tails_batches_hold_open(
    toy_checkpoint, monkeypatch
) -> None:
    """Many requests in little memory: the reserve is what their batches can hold open (a
    partial block per request and plane, and what a batch's tokens open), not the share."""
    from services.worker.runner_host import RunnerHost

    limits = BatchLimits(max_num_seqs=4, max_num_batched_tokens=40)
    host = RunnerHost(
        toy_checkpoint, "cpu", torch.bfloat16, kv_cache_dtype="int4-delta", batch_limits=limits
    )
    host.load()
    cfg = host.model.cfg
    shape = (cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim, 2)
    auto_block, int4_block = bytes_per_block("auto", *shape), bytes_per_block("int4-delta", *shape)
    memory = 100 * auto_block
    monkeypatch.setenv("RLT_WORKER_MAX_KV_BYTES", str(memory))
    # per plane: 4 partial blocks, 4 rows straddling a boundary, (40 - 8) // 16 more blocks
    open_bound = open_blocks_bound(cfg.total_ut_steps, 16, limits)
    assert open_bound == cfg.total_ut_steps * (4 + 4 + 2)
    fits = blocks_in_memory(memory, int4_block, auto_block, open_bound)
    assert -(-fits // 32) < open_bound  # the share alone would reserve less
    assert fits < blocks_in_memory(memory, int4_block, auto_block)
    assert fits == (memory - open_bound * auto_block) // int4_block
    host.check_geometry(fits, 16, "last_exited")
    with pytest.raises(MemoryError):
        host.check_geometry(fits + 1, 16, "last_exited")
