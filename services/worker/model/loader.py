"""Strict loader for HF-format Ouro checkpoints (config.json + safetensors, single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.checkpoint import log_checkpoint_notes
from services.common.model_config import CONFIG_FILE, ConfigError, OuroConfig

__all__ = ["CONFIG_FILE", "CheckpointError", "expected_shapes", "load_checkpoint"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Dtypes we accept on disk; anything else (int8, fp8, ...) would need dequantisation we lack.
_DISK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_LAYER_NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)


class CheckpointError(ValueError):
    """A checkpoint is malformed; the message names the offending tensor or file."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """A checkpoint's config.json is invalid; catchable as either error type."""


def expected_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name an Ouro checkpoint must hold, with its shape."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_dim, cfg.kv_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (q, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q)
        shapes[f"{p}.mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, i)
        for norm in _LAYER_NORMS:
            shapes[f"{p}.{norm}.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["model.early_exit_gate.weight"] = (1, h)
    shapes["model.early_exit_gate.bias"] = (1,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def _tensor_files(ckpt: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = ckpt / INDEX_FILE
    single = ckpt / SINGLE_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: invalid JSON: {e}") from e
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing or invalid 'weight_map'")
        out: dict[str, Path] = {}
        for name, fname in weight_map.items():
            # Refuse paths escaping the checkpoint directory: the index is untrusted input.
            if not isinstance(fname, str) or Path(fname).name != fname:
                raise CheckpointError(f"{index}: invalid shard file name for {name}: {fname!r}")
            shard = ckpt / fname
            if not shard.is_file():
                raise CheckpointError(f"{name}: shard file {shard} not found")
            out[name] = shard
        return out
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(f"{ckpt}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[OuroConfig, dict[str, torch.Tensor]]:
    """Load and validate a checkpoint; tensors are cast to ``dtype`` on CPU.

    Strict: any missing, unexpected or mis-shaped tensor raises CheckpointError. With tied
    embeddings ``lm_head.weight`` may be absent and then aliases the embedding.
    """
    if dtype not in _DISK_DTYPES:
        raise CheckpointError(f"unsupported load dtype {dtype}")
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: checkpoint directory not found")
    try:
        cfg = OuroConfig.from_checkpoint(ckpt)
    except ConfigError as e:
        raise CheckpointConfigError(str(e)) from e
    log_checkpoint_notes(cfg, ckpt)

    expected = expected_shapes(cfg)
    files = _tensor_files(ckpt)

    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{unexpected[0]}: unexpected tensor in checkpoint"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [n for n in expected if n not in files and n not in optional]
    if missing:
        raise CheckpointError(
            f"{missing[0]}: missing tensor in checkpoint"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )

    # Group by file so each shard is opened once.
    by_file: dict[Path, list[str]] = {}
    for name, fpath in files.items():
        by_file.setdefault(fpath, []).append(name)

    weights: dict[str, torch.Tensor] = {}
    for fpath, names in by_file.items():
        with safe_open(str(fpath), framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{name}: not found in shard {fpath.name}")
                t = f.get_tensor(name)
                want = expected[name]
                if tuple(t.shape) != want:
                    raise CheckpointError(f"{name}: expected shape {want}, found {tuple(t.shape)}")
                if t.dtype not in _DISK_DTYPES:
                    raise CheckpointError(f"{name}: unsupported dtype {t.dtype} on disk")
                t = t.to(dtype).contiguous()
                if not torch.isfinite(t).all():
                    raise CheckpointError(f"{name}: contains non-finite values")
                weights[name] = t

    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return cfg, weights
