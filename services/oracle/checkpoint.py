"""The oracle's own reading of an Ouro checkpoint: config.json (with HF OuroConfig's
defaults), generation_config.json and the safetensors weights, in float32. Independent of
the engine's loader on purpose, so a bug in one cannot hide in both."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file


@dataclass(frozen=True)
class OracleConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    total_ut_steps: int
    tie_word_embeddings: bool
    # config.json's eos, then generation_config.json's (HF's generate() stops at the latter)
    eos_token_ids: tuple[int, ...]
    early_exit_threshold: float
    default_max_tokens: int
    # per layer: None (full causal attention) or the sliding window's size in tokens
    windows: tuple[int | None, ...]


def _eos_list(eos: object) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]  # type: ignore[call-overload]


def _layer_windows(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    """HF OuroConfig: sliding_window only when use_sliding_window; layer_types, else sliding
    for layers >= max_window_layers (default 28)."""
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types") or [
        "sliding_attention"
        if window is not None and i >= raw.get("max_window_layers", 28)
        else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(window if t == "sliding_attention" else None for t in types)


def read_config(path: Path) -> OracleConfig:
    """config.json (and generation_config.json beside it), with HF OuroConfig's defaults."""
    raw = json.loads(path.read_text())
    gen_path = path.parent / "generation_config.json"
    # without a generation_config.json, HF derives the generation config from config.json
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else raw
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    kv_heads = raw.get("num_key_value_heads", 32)  # absent: HF's default; null: MHA
    kv_heads = heads if kv_heads is None else int(kv_heads)
    head_dim = raw.get("head_dim")
    head_dim = int(head_dim) if head_dim else hidden // heads
    if heads % kv_heads != 0:
        raise ValueError(f"num_attention_heads={heads} not divisible by kv heads={kv_heads}")
    eos_ids = tuple(
        dict.fromkeys(_eos_list(raw.get("eos_token_id")) + _eos_list(gen.get("eos_token_id")))
    )
    threshold = raw.get("early_exit_threshold")
    layers = int(raw["num_hidden_layers"])
    return OracleConfig(
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        total_ut_steps=int(raw.get("total_ut_steps", 4)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        early_exit_threshold=1.0 if threshold is None else float(threshold),
        default_max_tokens=int(gen.get("max_new_tokens") or 16),
        windows=_layer_windows(raw, layers),
    )


def read_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    single = ckpt / "model.safetensors"
    index = ckpt / "model.safetensors.index.json"
    if single.exists():
        tensors = load_file(str(single))
    elif index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(str(ckpt / shard)))
    else:
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {ckpt}")
    # The oracle is float32 throughout, whatever the checkpoint dtype.
    return {name: t.to(torch.float32) for name, t in tensors.items()}


@dataclass
class LayerWeights:
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    norm_in: torch.Tensor  # input_layernorm
    norm_attn_out: torch.Tensor  # input_layernorm_2
    norm_post: torch.Tensor  # post_attention_layernorm
    norm_mlp_out: torch.Tensor  # post_attention_layernorm_2


def take_tensor(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"checkpoint is missing tensor {name!r}")
    return tensors[name]
