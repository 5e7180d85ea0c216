"""Tests for the serial oracle (services/oracle) on a tiny random Ouro-format checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from services.oracle import ExitTracker, OracleResult, SerialOracle

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB, D = 32, 64, 2, 4, 2, 97, 4
HD = HIDDEN // HEADS
PROMPT = [5, 17, 42, 3, 88, 61, 9, 23, 70, 11]


def _write_checkpoint(path: Path, seed: int = 0) -> None:
    """Write a tiny random checkpoint in the HF Ouro format (self-contained on purpose)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_w() -> torch.Tensor:
        return 1.0 + rnd(HIDDEN, std=0.1)

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(VOCAB, HIDDEN, std=1.0),
        "model.norm.weight": norm_w(),
        # Gate std ~0.3 per weight gives logits of std ~1.7 on a unit-RMS state, so hazards
        # spread over (0, 1) and exits vary between tokens.
        "model.early_exit_gate.weight": rnd(1, HIDDEN, std=0.3),
        "model.early_exit_gate.bias": torch.tensor([-0.5]),
        "lm_head.weight": rnd(VOCAB, HIDDEN, std=0.5),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(HEADS * HD, HIDDEN, std=0.4)
        t[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HD, HIDDEN, std=0.4)
        t[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HD, HIDDEN, std=0.3)
        t[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HD, std=0.3)
        t[p + "mlp.gate_proj.weight"] = rnd(INTER, HIDDEN, std=0.2)
        t[p + "mlp.up_proj.weight"] = rnd(INTER, HIDDEN, std=0.2)
        t[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTER, std=0.2)
        for name in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            t[p + name + ".weight"] = norm_w()
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["OuroForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 128,
        "total_ut_steps": D,
        "early_exit_threshold": 1.0,
        "tie_word_embeddings": False,
        "eos_token_id": [96],
    }
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ouro_tiny")
    _write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def oracle(ckpt: Path) -> SerialOracle:
    return SerialOracle(ckpt)


# ---- exit policy arithmetic ----------------------------------------------------------------


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _run_policy(gate_logit: float, *, min_loops: int, max_loops: int, threshold: float) -> int:
    tracker = ExitTracker(min_loops, max_loops, threshold)
    for _ in range(max_loops):
        if tracker.observe(gate_logit):
            return tracker.loops
    raise AssertionError("policy never exited")


@pytest.mark.unit
def test_policy_cdf_is_float32_recurrence() -> None:
    tracker = ExitTracker(min_loops=99, max_loops=99, threshold=1.0)
    lam = np.float32(torch.sigmoid(torch.tensor(_logit(0.4), dtype=torch.float32)).item())
    remaining = np.float32(1.0)
    for expected in (0.4, 0.64, 0.784):
        assert not tracker.observe(_logit(0.4))
        remaining = np.float32(remaining * np.float32(np.float32(1.0) - lam))
        assert tracker.cdf.dtype == torch.float32
        assert tracker.cdf.item() == float(np.float32(1.0) - remaining)
        assert tracker.cdf.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.unit
def test_policy_exit_rules() -> None:
    h = _logit(0.4)
    assert _run_policy(h, min_loops=1, max_loops=4, threshold=0.6) == 2  # cdf 0.64 >= 0.6
    assert _run_policy(h, min_loops=3, max_loops=4, threshold=0.5) == 3  # cdf 0.64 but r < 3
    assert _run_policy(h, min_loops=1, max_loops=2, threshold=0.99) == 2  # max_loops caps
    assert _run_policy(h, min_loops=1, max_loops=4, threshold=0.3) == 1


@pytest.mark.unit
def test_policy_threshold_one_is_fixed_depth() -> None:
    # sigmoid(100) rounds to exactly 1.0 in float32, so cdf == 1.0 == threshold after loop 1;
    # threshold 1.0 still means "no early exit".
    tracker = ExitTracker(min_loops=1, max_loops=4, threshold=1.0)
    assert not tracker.observe(100.0)
    assert tracker.cdf.item() == 1.0
    assert _run_policy(100.0, min_loops=1, max_loops=4, threshold=1.0) == 4
    assert tracker.margin == math.inf  # the threshold test is never evaluated


@pytest.mark.unit
def test_policy_margin() -> None:
    tracker = ExitTracker(min_loops=2, max_loops=4, threshold=0.7)
    tracker.observe(_logit(0.4))  # r=1 < min_loops: not evaluated
    assert tracker.margin == math.inf
    tracker.observe(_logit(0.4))  # cdf 0.64
    assert tracker.margin == pytest.approx(0.06, abs=1e-6)


# ---- model math ------------------------------------------------------------------------------


def _functional_reference_logits(ckpt: Path, tokens: list[int]) -> torch.Tensor:
    """Second, independent formulation of the full-depth forward (SDPA with GQA)."""
    from safetensors.torch import load_file

    w = load_file(str(ckpt / "model.safetensors"))

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    n = len(tokens)
    pos = torch.arange(n, dtype=torch.float32)
    inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [heads, n, hd]
        x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for _ in range(D):
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            x = rms(h, w[p + "input_layernorm.weight"])
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, HEADS, HD).transpose(0, 1)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HD).transpose(0, 1)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HD).transpose(0, 1)
            a = F.scaled_dot_product_attention(
                rope(q)[None], rope(k)[None], v[None], is_causal=True, enable_gqa=True
            )[0]
            a = a.transpose(0, 1).reshape(n, HIDDEN) @ w[p + "self_attn.o_proj.weight"].T
            h = h + rms(a, w[p + "input_layernorm_2.weight"])
            x = rms(h, w[p + "post_attention_layernorm.weight"])
            g = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
            m = g @ w[p + "mlp.down_proj.weight"].T
            h = h + rms(m, w[p + "post_attention_layernorm_2.weight"])
        h = rms(h, w["model.norm.weight"])
    return h @ w["lm_head.weight"].T


@pytest.mark.oracle
def test_prompt_logits_match_functional_reference(oracle: SerialOracle, ckpt: Path) -> None:
    got = oracle.prompt_logits(PROMPT)
    assert got.shape == (len(PROMPT), VOCAB) and got.dtype == torch.float32
    # Different op orders (SDPA vs explicit softmax) round differently; the random model
    # amplifies float32 rounding through D loops, so logits agree to ~1e-4, not bitwise.
    want = _functional_reference_logits(ckpt, PROMPT)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.oracle
def test_first_token_comes_from_last_prompt_logits(oracle: SerialOracle) -> None:
    seen: list[torch.Tensor] = []

    def recording(logits: torch.Tensor, index: int) -> int:
        seen.append(logits.clone())
        return int(torch.argmax(logits))

    res = oracle.generate(PROMPT, max_tokens=1, sampler=recording)
    assert res.finish_reason == "length" and res.exit_depths == [D]
    # Same math; only the GEMM shape of the coda differs ([P, H] vs [1, H]).
    torch.testing.assert_close(seen[0], oracle.prompt_logits(PROMPT)[-1], atol=1e-5, rtol=0)
    assert res.token_ids == [int(torch.argmax(seen[0]))]


@pytest.mark.oracle
def test_last_exited_is_independent_of_prefill_chunking(oracle: SerialOracle) -> None:
    base = oracle.generate(PROMPT, max_tokens=6, exit_threshold=0.5, min_loops=1)
    whole = oracle.prompt_logits(PROMPT)
    for chunk in (1, 3, 4):
        # Mathematically identical; chunked GEMMs only change float32 rounding (~1e-4 here).
        chunked = oracle.prompt_logits(PROMPT, prefill_chunk_size=chunk)
        torch.testing.assert_close(chunked, whole, atol=1e-3, rtol=0)
        res = oracle.generate(
            PROMPT, max_tokens=6, exit_threshold=0.5, min_loops=1, prefill_chunk_size=chunk
        )
        assert res.token_ids == base.token_ids and res.exit_depths == base.exit_depths


@pytest.mark.oracle
def test_full_depth_decode_equals_dense_recompute(oracle: SerialOracle) -> None:
    # With threshold 1.0 every token runs all D loops, so in LAST_EXITED the decode-time KV at
    # plane d holds exactly the depth-d KV a dense pass over prompt+generated would compute.
    res = oracle.generate(PROMPT, max_tokens=6)
    assert res.exit_depths == [D] * 6
    dense = oracle.prompt_logits(PROMPT + res.token_ids[:-1])
    assert dense[len(PROMPT) - 1 :].argmax(-1).tolist() == res.token_ids
    gaps = (dense[len(PROMPT) - 1 :].topk(2).values.diff(dim=-1) * -1).squeeze(-1)
    # float32 rounding differs between one dense matmul and step-by-step decode (and with the
    # BLAS thread count); logits here are O(10), so gaps agree to ~1e-3, tokens exactly
    assert gaps.tolist() == pytest.approx([s.top2_gap for s in res.steps], abs=2e-3)


# ---- layouts -----------------------------------------------------------------------------------


def _early_exit_run(oracle: SerialOracle, layout: str, **kw: object) -> OracleResult:
    return oracle.generate(
        PROMPT, max_tokens=12, min_loops=1, exit_threshold=0.6, kv_layout=layout, **kw
    )


@pytest.mark.oracle
def test_early_exits_happen(oracle: SerialOracle) -> None:
    res = _early_exit_run(oracle, "last_exited")
    # The fixture must exercise early exit, else the layout tests below prove nothing.
    assert any(d < D for d in res.exit_depths[1:])
    assert len(set(res.exit_depths[1:])) > 1


@pytest.mark.oracle
def test_layouts_differ_with_early_exit(oracle: SerialOracle) -> None:
    a = _early_exit_run(oracle, "last_exited")
    b = _early_exit_run(oracle, "shared")
    # The whole prompt is one atomic chunk in both, so prefill (and token 0) is identical.
    assert a.token_ids[0] == b.token_ids[0] and a.steps[0].top2_gap == b.steps[0].top2_gap
    # Decode reads depth-min(d, e) history (LAST_EXITED) versus latest history (SHARED).
    assert a.token_ids != b.token_ids
    assert any(
        abs(x.top2_gap - y.top2_gap) > 1e-3 for x, y in zip(a.steps[1:], b.steps[1:], strict=False)
    )


@pytest.mark.oracle
def test_layouts_differ_even_at_fixed_depth(oracle: SerialOracle) -> None:
    # Without early exit the layouts still differ: LAST_EXITED decode at depth d < D-1 reads
    # every history position's depth-d KV, while SHARED reads their final-depth version.
    # Only token 0 (pure prefill, one chunk) agrees.
    a = oracle.generate(PROMPT, max_tokens=4, kv_layout="last_exited")
    b = oracle.generate(PROMPT, max_tokens=4, kv_layout="shared")
    assert a.exit_depths == b.exit_depths == [D] * 4
    assert a.steps[0].top2_gap == b.steps[0].top2_gap
    assert abs(a.steps[1].top2_gap - b.steps[1].top2_gap) > 1e-3
    assert a.token_ids != b.token_ids


@pytest.mark.oracle
def test_shared_layout_depends_on_prefill_chunking(oracle: SerialOracle) -> None:
    # In SHARED a later chunk attends to earlier chunks' final-depth KV at every loop, which
    # a single chunk never does, so the last prompt position's logits change.
    whole = oracle.prompt_logits(PROMPT, kv_layout="shared")
    torch.testing.assert_close(whole, oracle.prompt_logits(PROMPT), atol=0, rtol=0)
    chunked = oracle.prompt_logits(PROMPT, kv_layout="shared", prefill_chunk_size=4)
    torch.testing.assert_close(chunked[:4], whole[:4], atol=1e-3, rtol=0)  # first chunk: same
    assert (chunked[4:] - whole[4:]).abs().amax(dim=-1).min() > 0.1  # later chunks: not


# ---- stops and replay ------------------------------------------------------------------------


@pytest.mark.unit
def test_eos_stop_ignore_eos_and_length(ckpt: Path, tmp_path: Path) -> None:
    ref = SerialOracle(ckpt).generate(PROMPT, max_tokens=5, ignore_eos=True)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 5
    eos = ref.token_ids[2]
    first = ref.token_ids.index(eos)

    # A copy of the checkpoint whose eos is a token the model actually generates.
    shutil.copy(ckpt / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    o = SerialOracle(tmp_path)
    assert o.eos_token_ids == (eos,)

    stopped = o.generate(PROMPT, max_tokens=5)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ref.token_ids[: first + 1]  # the eos token is included

    cont = o.generate(PROMPT, max_tokens=5, ignore_eos=True)
    assert cont.finish_reason == "length" and cont.token_ids == ref.token_ids

    # stop_token_ids apply even with ignore_eos.
    by_stop = o.generate(PROMPT, max_tokens=5, ignore_eos=True, stop_token_ids=[eos])
    assert by_stop.finish_reason == "stop" and by_stop.token_ids == stopped.token_ids


@pytest.mark.oracle
def test_forced_exit_depths_replay(oracle: SerialOracle) -> None:
    for layout in ("last_exited", "shared"):
        run = _early_exit_run(oracle, layout)
        replay = oracle.generate(
            PROMPT, max_tokens=12, kv_layout=layout, forced_exit_depths=run.exit_depths
        )
        assert replay.token_ids == run.token_ids
        assert replay.exit_depths == run.exit_depths
    # Forcing overrides the policy (which never exits at 1 with min_loops=2).
    forced = [D, 1, 1, 1, 1, 1]
    res = oracle.generate(PROMPT, max_tokens=6, ignore_eos=True, forced_exit_depths=forced)
    assert res.exit_depths == forced


@pytest.mark.unit
def test_sharded_tied_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["lm_head.weight"]
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    # Reference: the single-file checkpoint with lm_head replaced by the embedding.
    single = tmp_path / "single"
    single.mkdir()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(single / "model.safetensors"))
    (single / "config.json").write_text(json.dumps(cfg))
    torch.testing.assert_close(
        SerialOracle(tmp_path).prompt_logits(PROMPT),
        SerialOracle(single).prompt_logits(PROMPT),
        atol=0,
        rtol=0,
    )


@pytest.mark.oracle
def test_rejects_bad_input(oracle: SerialOracle) -> None:
    with pytest.raises(ValueError):
        oracle.generate([], max_tokens=1)
    with pytest.raises(ValueError):
        oracle.generate([VOCAB], max_tokens=1)
    with pytest.raises(ValueError):
        oracle.generate(PROMPT, max_tokens=1, kv_layout="paged")
    with pytest.raises(ValueError):
        oracle.generate(PROMPT, max_tokens=1, max_loops=D + 1)
    with pytest.raises(ValueError):
        oracle.generate(PROMPT, max_tokens=200)  # beyond max_position_embeddings


@pytest.mark.unit
def test_kv_jitter_perturbs_at_float32_resolution_and_repeats_by_seed() -> None:
    """``kv_jitter_seed``: every K/V written moves by ~2e-6 relative, the same values for a
    seed, others for another seed; without a seed nothing moves."""
    from services.oracle.dense_kv import JITTER, DenseKV

    k = torch.randn(6, 2, 16)

    def written(seed: int | None) -> torch.Tensor:
        kv = DenseKV(2, 1, 6, 2, 16, "int4-delta", group_size=2, jitter_seed=seed)
        kv.write(0, 0, torch.arange(6), k, k)
        return kv.k[0][0].clone()

    assert torch.equal(written(None), k)
    one, again, other = written(1), written(1), written(2)
    assert torch.equal(one, again) and not torch.equal(one, other)
    relative = ((one - k) / k).abs()
    assert 0 < relative.max() < 10 * JITTER and relative.mean() > JITTER / 10
