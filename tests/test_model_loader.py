"""Ouro model, strict checkpoint loader and toy checkpoint writer."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from services.common.model_config import ConfigError, OuroConfig
from services.worker.model.loader import CheckpointError, expected_shapes, load_checkpoint
from services.worker.model.ouro import OuroModel, PassAttention
from services.worker.model.toy import EOS_TOKEN, toy_config, write_toy_checkpoint

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 300, 42, 99, 7, 260, 3]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy"), seed=0)


@pytest.fixture(scope="module")
def toy_model(toy_dir: Path) -> OuroModel:
    return OuroModel.from_checkpoint(toy_dir)


@pytest.fixture()
def ckpt_copy(toy_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(toy_dir, dst)
    return dst


class DenseKV:
    """One sequence's K/V per depth, each plane one block as long as the sequence may get:
    the model's paged ops see a one-segment pass."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.planes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def loop(
        self, model: OuroModel, h: torch.Tensor, depth: int, start: int, rope_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One core loop of rows at positions start.. (RoPE at ``rope_offset`` beyond)."""
        if depth not in self.planes:
            shape = (model.num_layers, 1, self.capacity, model.num_kv_heads, model.head_dim)
            self.planes[depth] = (torch.zeros(shape), torch.zeros(shape))
        k, v = self.planes[depth]
        t = h.shape[0]
        slots = torch.arange(start, start + t)
        attn = PassAttention(
            slots,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([start + t], dtype=torch.int32),
            torch.tensor([0, t], dtype=torch.int32),
            t,
        )
        return model.core_loop(h, model.rope(slots + rope_offset), k, v, attn)


def full_depth(model: OuroModel, ids: list[int], start: int, cache: DenseKV):
    """Run tokens ``ids`` at positions start.. through all loops; return (h, gate logits [D,T])."""
    h = model.prelude(torch.tensor(ids))
    gates = []
    for d in range(model.cfg.total_ut_steps):
        h, g = cache.loop(model, h, d, start)
        gates.append(g)
    return h, torch.stack(gates)


def greedy_logits(model: OuroModel, steps: int = 4) -> torch.Tensor:
    """Prefill then incremental full-depth greedy decode; stacked float32 logits."""
    cache = DenseKV()
    ids = list(PROMPT)
    h, _ = full_depth(model, ids, 0, cache)
    out = [model.coda(h[-1:])]
    for _ in range(steps):
        nxt = int(out[-1].argmax(-1))
        h, _ = full_depth(model, [nxt], len(ids), cache)
        ids.append(nxt)
        out.append(model.coda(h))
    return torch.cat(out)


# ---------------------------------------------------------------- round trip, numerics


def test_two_loads_bit_identical(toy_dir: Path) -> None:
    a = OuroModel.from_checkpoint(toy_dir)
    b = OuroModel.from_checkpoint(toy_dir)
    la, lb = greedy_logits(a), greedy_logits(b)
    assert la.dtype == torch.float32 and la.shape == (5, a.cfg.vocab_size)
    assert torch.equal(la, lb)
    # Same seed -> same bytes; a different seed -> different weights.
    again = write_toy_checkpoint(toy_dir.parent / "again", seed=0)
    other = write_toy_checkpoint(toy_dir.parent / "other", seed=1)
    w0 = load_file(toy_dir / "model.safetensors")
    assert all(torch.equal(w0[k], v) for k, v in load_file(again / "model.safetensors").items())
    w1 = load_file(other / "model.safetensors")
    assert not torch.equal(w0["model.norm.weight"], w1["model.norm.weight"])


def test_incremental_decode_matches_full_recompute(toy_model: OuroModel) -> None:
    ids = [*PROMPT, 11, 12]
    h_full, g_full = full_depth(toy_model, ids, 0, DenseKV())
    cache = DenseKV()
    full_depth(toy_model, ids[:-2], 0, cache)
    h_inc, g_inc = full_depth(toy_model, ids[-2:], len(ids) - 2, cache)
    torch.testing.assert_close(h_inc, h_full[-2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_inc, g_full[:, -2:], rtol=1e-5, atol=1e-5)


def _reference_loop(
    w: dict[str, torch.Tensor], cfg: OuroConfig, h: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent straight-from-the-spec loop (separate projections, explicit GQA)."""

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return w[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    hd, nh, nkv, t = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, h.shape[0]
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1)[:, None], torch.cat([ang, ang], -1)[:, None]
    cos, sin = cos.cos(), sin.sin()

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        x = norm(h, f"{p}.input_layernorm.weight")
        q = rope((x @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, nh, hd))
        k = rope((x @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, nkv, hd))
        v = (x @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, nkv, hd)
        outs = []
        for head in range(nh):
            kh, vh = k[:, head // (nh // nkv)], v[:, head // (nh // nkv)]
            s = (q[:, head] @ kh.T) / hd**0.5
            s = s.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
            outs.append(s.softmax(-1) @ vh)
        a = torch.cat(outs, -1) @ w[f"{p}.self_attn.o_proj.weight"].T
        h = h + norm(a, f"{p}.input_layernorm_2.weight")
        x = norm(h, f"{p}.post_attention_layernorm.weight")
        gate = x @ w[f"{p}.mlp.gate_proj.weight"].T
        m = (F.silu(gate) * (x @ w[f"{p}.mlp.up_proj.weight"].T)) @ w[f"{p}.mlp.down_proj.weight"].T
        h = h + norm(m, f"{p}.post_attention_layernorm_2.weight")
    h = norm(h, "model.norm.weight")
    g = h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]
    return h, g.squeeze(-1)


def test_matches_independent_reference(toy_dir: Path, toy_model: OuroModel) -> None:
    cfg, w = load_checkpoint(toy_dir)
    ids = torch.tensor(PROMPT)
    pos = torch.arange(len(PROMPT)) + 1000  # non-zero positions exercise RoPE
    h_ref = w["model.embed_tokens.weight"][ids]
    h = toy_model.prelude(ids)
    for _ in range(2):  # two loops: the next loop consumes the normed state
        h_ref, g_ref = _reference_loop(w, cfg, h_ref, pos)
        h, g = DenseKV().loop(toy_model, h, 0, 0, rope_offset=1000)
        torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
    assert g.dtype == torch.float32 and g.shape == (len(PROMPT),)
    logits = toy_model.coda(h)
    torch.testing.assert_close(logits, h_ref @ w["lm_head.weight"].T, rtol=1e-4, atol=1e-4)
    assert len(set(logits.argmax(-1).tolist())) > 1  # not degenerate


# ---------------------------------------------------------------- strictness


def _edit_tensors(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor(ckpt_copy: Path) -> None:
    _edit_tensors(ckpt_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(ckpt_copy)


def test_extra_tensor(ckpt_copy: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _edit_tensors(ckpt_copy, add)
    with pytest.raises(CheckpointError, match=r"rotary_emb\.inv_freq: unexpected"):
        load_checkpoint(ckpt_copy)


def test_wrong_shape(ckpt_copy: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 32)

    _edit_tensors(ckpt_copy, shrink)
    msg = r"model\.layers\.1\.mlp\.up_proj\.weight: expected shape \(128, 64\), found \(128, 32\)"
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(ckpt_copy)


def test_non_finite_tensor(ckpt_copy: Path) -> None:
    _edit_tensors(ckpt_copy, lambda t: t["model.norm.weight"].__setitem__(3, float("nan")))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_checkpoint(ckpt_copy)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", None),
        ("eos_token_id", "x"),  # absent is fine (HF: optional); see test_checkpoint_fidelity
        ("num_key_value_heads", 3),
        ("vocab_size", "x"),
    ],
)
def test_bad_config_field(ckpt_copy: Path, field: str, value: object) -> None:
    cfg_path = ckpt_copy / "config.json"
    raw = json.loads(cfg_path.read_text())
    if value is None:
        del raw[field]
    else:
        raw[field] = value
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=field) as info:
        load_checkpoint(ckpt_copy)
    assert isinstance(info.value, ConfigError)


def test_missing_files(ckpt_copy: Path) -> None:
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(ckpt_copy)


def test_sharded_equals_single(toy_dir: Path, ckpt_copy: Path) -> None:
    tensors = load_file(ckpt_copy / "model.safetensors")
    (ckpt_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, ckpt_copy / fname)
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (ckpt_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg_a, wa = load_checkpoint(toy_dir)
    cfg_b, wb = load_checkpoint(ckpt_copy)
    assert cfg_a == cfg_b and wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # A shard that lacks a tensor its index promises is named.
    save_file(
        {n: tensors[n] for n in names[1::2][1:]}, ckpt_copy / "model-00002-of-00002.safetensors"
    )
    with pytest.raises(CheckpointError, match=names[1].replace(".", r"\.")):
        load_checkpoint(ckpt_copy)


def test_bf16_on_disk(toy_dir: Path, tmp_path: Path) -> None:
    bf = write_toy_checkpoint(tmp_path / "bf16", seed=0, dtype=torch.bfloat16)
    assert json.loads((bf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, w32 = load_checkpoint(toy_dir)
    _, wbf = load_checkpoint(bf)
    assert all(t.dtype == torch.float32 for t in wbf.values())
    for k, t in w32.items():
        assert torch.equal(wbf[k], t.to(torch.bfloat16).float()), k
    # The bf16 model itself runs and returns float32 logits/gates.
    m = OuroModel.from_checkpoint(bf, dtype=torch.bfloat16)
    h, g = full_depth(m, PROMPT, 0, DenseKV())
    assert h.dtype == torch.bfloat16 and g.dtype == torch.float32
    assert torch.isfinite(m.coda(h)).all()


def test_tied_embeddings(ckpt_copy: Path) -> None:
    raw = json.loads((ckpt_copy / "config.json").read_text())
    raw["tie_word_embeddings"] = True
    (ckpt_copy / "config.json").write_text(json.dumps(raw))
    _edit_tensors(ckpt_copy, lambda t: t.pop("lm_head.weight"))
    cfg, w = load_checkpoint(ckpt_copy)
    assert cfg.tie_word_embeddings
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    OuroModel(cfg, w)


# ---------------------------------------------------------------- config


def test_config_round_trip_and_eos_list() -> None:
    cfg = toy_config("toy")
    d = cfg.to_hf_dict()
    assert d["model_type"] == "ouro" and d["architectures"] == ["OuroForCausalLM"]
    assert d["eos_token_id"] == 0 and "eos_token_ids" not in d and d["hidden_act"] == "silu"
    assert OuroConfig.from_dict(d) == cfg
    d2 = {**d, "eos_token_id": [0, 3]}
    del d2["head_dim"]
    cfg2 = OuroConfig.from_dict(d2)
    assert cfg2.eos_token_ids == (0, 3) and cfg2.head_dim == 16
    with pytest.raises(ConfigError, match="intermediate_size"):
        OuroConfig.from_dict({k: v for k, v in d.items() if k != "intermediate_size"})
    small = toy_config("small")
    assert set(expected_shapes(small)) == set(expected_shapes(cfg)) | {
        n.replace("layers.0", f"layers.{i}")
        for n in expected_shapes(cfg)
        if "layers.0." in n
        for i in (2, 3)
    }


def test_writer_shards_load_like_one_file(toy_dir: Path, tmp_path: Path) -> None:
    # A shard budget below the model's size makes the writer cut HF-style shards plus an
    # index; the strict loader must read back exactly the single-file weights.
    sharded = write_toy_checkpoint(tmp_path / "sharded", seed=0, shard_bytes=64 << 10)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert not list(sharded.glob("*.tmp"))
    one, many = load_checkpoint(toy_dir), load_checkpoint(sharded)
    assert one[0] == many[0] and set(one[1]) == set(many[1])
    assert all(torch.equal(one[1][k], many[1][k]) for k in one[1])


def test_1_4b_size_has_the_published_shape() -> None:
    # Checked from the config alone: writing it takes 3 GB and 20 s (benchmarks do that).
    cfg = toy_config("1.4b")
    params = sum(math.prod(shape) for shape in expected_shapes(cfg).values())
    assert 1.40e9 < params < 1.46e9
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (2048, 24, 128)
    assert cfg.total_ut_steps == 4


# ---------------------------------------------------------------- toy behaviour


def exit_depths(gates: torch.Tensor, threshold: float, min_loops: int) -> list[int]:
    """DESIGN §1 exit rule over per-loop gate logits [D, T]."""
    remaining = torch.ones(gates.shape[1])
    depth = torch.full((gates.shape[1],), gates.shape[0])
    done = torch.zeros(gates.shape[1], dtype=torch.bool)
    for r, g in enumerate(gates, start=1):
        remaining = remaining * (1 - torch.sigmoid(g))
        now = ~done & (r >= min_loops) & (1 - remaining >= threshold)
        depth[now] = r
        done |= now
    return depth.tolist()


def test_gate_gives_mixed_exit_depths(toy_model: OuroModel) -> None:
    gen = torch.Generator().manual_seed(123)
    depths: list[int] = []
    for _ in range(4):
        ids = torch.randint(1, toy_model.cfg.vocab_size, (12,), generator=gen).tolist()
        _, gates = full_depth(toy_model, ids, 0, DenseKV())
        depths += exit_depths(gates, threshold=0.7, min_loops=1)
    assert len(set(depths)) >= 2, depths


def test_tokenizer(toy_dir: Path) -> None:
    tok = Tokenizer.from_file(str(toy_dir / "tokenizer.json"))
    cfg = OuroConfig.from_json_file(toy_dir / "config.json")
    assert tok.get_vocab_size() <= cfg.vocab_size
    assert tok.token_to_id(EOS_TOKEN) == cfg.eos_token_ids[0]
    text = "The quick brown fox jumps over the lazy dog, twice!"
    enc = tok.encode(text)
    assert all(0 <= i < cfg.vocab_size for i in enc.ids)
    assert tok.decode(enc.ids) == text
    assert tok.decode(tok.encode("héllo ✓ 42").ids) == "héllo ✓ 42"  # byte-level: no UNK
