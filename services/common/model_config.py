"""Ouro model configuration, parsed from / written to the published HF ``config.json`` format."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json is missing a required field or holds an invalid value."""


# Fields every Ouro config.json must carry; the rest have defaults matching the HF model.
_REQUIRED_INT = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class OuroConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    total_ut_steps: int
    early_exit_threshold: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    head_dim: int
    # Kept only so that to_hf_dict round-trips the on-disk dtype; the loader casts anyway.
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        # Validate here so both from_dict and direct construction reject bad shapes early.
        for name in (
            *_REQUIRED_INT,
            "num_key_value_heads",
            "max_position_embeddings",
            "total_ut_steps",
            "head_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                "config field 'num_key_value_heads' must divide num_attention_heads "
                f"({self.num_key_value_heads} vs {self.num_attention_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive number, got {value!r}")
        if not math.isfinite(self.early_exit_threshold) or not (
            0.0 <= self.early_exit_threshold <= 1.0
        ):
            raise ConfigError(
                "config field 'early_exit_threshold' must be in [0, 1], "
                f"got {self.early_exit_threshold!r}"
            )
        if not self.eos_token_ids:
            raise ConfigError("config field 'eos_token_id' must name at least one token")
        for tok in (*self.eos_token_ids, self.bos_token_id):
            if tok is not None and not (0 <= tok < self.vocab_size):
                raise ConfigError(
                    f"special token id {tok} is outside the vocabulary (size {self.vocab_size})"
                )

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OuroConfig:
        """Parse an HF Ouro ``config.json`` dict; raise ConfigError naming the bad field."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "ouro")
        if model_type != "ouro":
            raise ConfigError(f"config field 'model_type' must be 'ouro', got {model_type!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config field 'hidden_act' must be 'silu', got {act!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ConfigError(f"config field {flag!r} is not supported (Ouro has no biases)")
        if d.get("rope_scaling"):
            raise ConfigError("config field 'rope_scaling' is not supported")

        def req_int(name: str) -> int:
            if name not in d:
                raise ConfigError(f"config is missing required field {name!r}")
            return _as_int(name, d[name])

        hidden = req_int("hidden_size")
        heads = req_int("num_attention_heads")
        vals: dict[str, Any] = {name: req_int(name) for name in _REQUIRED_INT}
        vals["num_key_value_heads"] = _as_int(
            "num_key_value_heads", d.get("num_key_value_heads", heads)
        )
        if "eos_token_id" not in d or d["eos_token_id"] is None:
            raise ConfigError("config is missing required field 'eos_token_id'")
        eos = d["eos_token_id"]
        eos_list = eos if isinstance(eos, list | tuple) else [eos]
        vals["eos_token_ids"] = tuple(_as_int("eos_token_id", e) for e in eos_list)
        bos = d.get("bos_token_id")
        vals["bos_token_id"] = None if bos is None else _as_int("bos_token_id", bos)
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads != 0:
                raise ConfigError(
                    f"config field 'hidden_size' ({hidden}) is not divisible by "
                    f"num_attention_heads ({heads}) and no 'head_dim' is given"
                )
            head_dim = hidden // heads
        vals["head_dim"] = _as_int("head_dim", head_dim)
        vals["rms_norm_eps"] = _as_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6))
        vals["rope_theta"] = _as_float("rope_theta", d.get("rope_theta", 1_000_000.0))
        vals["max_position_embeddings"] = _as_int(
            "max_position_embeddings", d.get("max_position_embeddings", 4096)
        )
        vals["total_ut_steps"] = _as_int("total_ut_steps", d.get("total_ut_steps", 4))
        vals["early_exit_threshold"] = _as_float(
            "early_exit_threshold", d.get("early_exit_threshold", 1.0)
        )
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"config field 'tie_word_embeddings' must be a bool, got {tie!r}")
        vals["tie_word_embeddings"] = tie
        dtype = d.get("torch_dtype", d.get("dtype", "float32"))
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"config field 'torch_dtype' is unsupported: {dtype!r}")
        vals["torch_dtype"] = dtype
        return cls(**vals)

    @classmethod
    def from_json_file(cls, path: str | Path) -> OuroConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: config file not found") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON: {e}") from e
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """The published HF Ouro config.json layout (field names exactly as HF uses them)."""
        eos: int | list[int] = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "total_ut_steps": self.total_ut_steps,
            "early_exit_threshold": self.early_exit_threshold,
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "vocab_size": self.vocab_size,
        }


def _as_int(name: str, value: Any) -> int:
    # bool is an int subclass in Python; a JSON true is never a valid size.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config field {name!r} must be an int, got {value!r}")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config field {name!r} must be a number, got {value!r}")
    return float(value)
