"""``rlt bench --only kv_codec``'s arithmetic: capacity by real block bytes under the
scheduler's fit rule, and a simulated device that charges KV bytes by codec."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_codec import block_bytes
from services.bench.comparisons import kv_codec
from services.common.fit import KVGeometry, blocks_in_memory, kv_tokens
from services.worker.model.toy import toy_config
from services.worker.sim import SimCostModel

pytestmark = pytest.mark.unit


def test_fp8_memory_holds_the_blocks_its_bytes_allow() -> None:
    cfg = toy_config("1.4b")
    args = (16, cfg.num_key_value_heads, cfg.head_dim, 2)
    auto = cfg.num_hidden_layers * block_bytes("auto", *args)
    fp8 = cfg.num_hidden_layers * block_bytes("fp8", *args)
    memory = 10 << 30
    ratio = blocks_in_memory(memory, fp8) / blocks_in_memory(memory, auto)
    assert 1.93 < ratio < 1.95  # 512 / 264 bytes per token and head


def test_capacity_is_the_fit_rule_at_real_bytes() -> None:
    shape = kv_codec._shape(toy_config("1.4b"))
    memory = 40 << 30
    cap = kv_codec.capacity(shape, memory)
    block_id = shape["layers"] * block_bytes("auto", 16, shape["kv_heads"], shape["head_dim"], 2)
    geometry = KVGeometry(16, blocks_in_memory(memory, block_id), shape["planes"])
    assert cap["auto"] == geometry.num_blocks // geometry.blocks_for(kv_tokens(2048 - 127, 128))
    assert cap["auto"] < cap["fp8"] < cap["int4-delta"]


def test_simulated_pass_reads_fewer_kv_bytes_under_a_codec() -> None:
    cfg = toy_config("1.4b")
    auto = SimCostModel.for_model(cfg)
    fp8 = SimCostModel.for_model(cfg, kv_cache_dtype="fp8")
    assert auto.kv_bytes_per_token == 24 * 2 * 16 * 128 * 2  # unchanged for auto
    assert fp8.kv_bytes_per_token == auto.kv_bytes_per_token * 264 / 512
    assert fp8.core_pass_s(32, 32 * 2048, 32 * 2048) < auto.core_pass_s(32, 32 * 2048, 32 * 2048)


def test_targets_are_judged_from_the_figures() -> None:
    shapes = {"Ouro-1.4B": kv_codec._shape(toy_config("1.4b"))}
    c = {
        "bytes": kv_codec.bytes_table(shapes),
        "capacity": {"requests": kv_codec.capacity(shapes["Ouro-1.4B"], 40 << 30)},
        "simulated": kv_codec.simulated_decode(),
    }
    judged = {t["target"]["text"]: t for t in kv_codec.targets(c)}
    fp8_bytes = judged["fp8 KV bytes per token <= 0.55x auto"]
    assert fp8_bytes["median"] == pytest.approx(405_504 / 786_432)
    assert all(t["reached"] == (t["median"] <= 0.55) for t in [fp8_bytes])


def test_a_simulated_worker_reads_kv_at_its_codec_bytes(toy_checkpoint) -> None:
    from services.worker.runner_host import RunnerHost

    costs = {}
    for codec in ("auto", "fp8"):
        host = RunnerHost(toy_checkpoint, "sim", torch.float32, kv_cache_dtype=codec)
        host.load()
        host.make_runner(64, 16, "last_exited")
        costs[codec] = host.runner.cost.kv_bytes_per_token
    assert costs["fp8"] == costs["auto"] * 264 / 512


def test_int4_delta_passes_read_the_chain_of_planes_below() -> None:
    """A pass at loop d decodes planes 0..d (each a delta from the one below), plus the
    row's full-precision tail block: deeper loops read more."""
    cfg = toy_config("1.4b")
    int4 = SimCostModel.for_model(cfg, kv_cache_dtype="int4-delta")
    auto = SimCostModel.for_model(cfg)
    tail = 16 * auto.kv_bytes_per_token / int4.kv_bytes_per_token
    assert int4.kv_tokens_read(2048, 0) == pytest.approx(2048 + tail)
    assert int4.kv_tokens_read(2048, 3) == pytest.approx(4 * 2048 + tail)
    assert auto.kv_tokens_read(2048, 3) == 2048
    sim = {(r["codec"], r["rows"], r["context"]): r for r in kv_codec.simulated_decode()}

    def vs_auto(every: int) -> float:
        name = f"int4-delta (anchor every {every})"
        return sim[(name, 32, 2048)]["tokens_per_s"] / sim[("auto", 32, 2048)]["tokens_per_s"]

    # the chain over 4 loops reads 2.5 planes of codes on average (~0.82x auto's bytes)
    assert 1.0 < vs_auto(4) < 1.6
    # anchors every 2 loops: 1.5 planes; every loop: 1 plane, the fewest bytes
    assert vs_auto(4) < vs_auto(2) < vs_auto(1)


@pytest.mark.parametrize("every", [0, 1, 2, 3, 4])
def test_int4_delta_passes_read_from_the_anchor_at_or_below(every: int) -> None:
    """Anchors every ``every`` loops (0: plane 0 alone): a pass at loop d reads the planes
    from the last anchor at or below d up to d; a context token's bytes do not change."""
    cfg = toy_config("1.4b")
    chained = SimCostModel.for_model(cfg, kv_cache_dtype="int4-delta")
    cost = SimCostModel.for_model(cfg, kv_cache_dtype="int4-delta", kv_int4_anchor_every=every)
    assert cost.kv_bytes_per_token == chained.kv_bytes_per_token
    tail = cost.tail_tokens
    for d in range(4):
        anchor = max(a for a in range(d + 1) if a == 0 or (every and a % every == 0))
        assert cost.kv_tokens_read(2048, d) == pytest.approx(2048 * (d - anchor + 1) + tail)
