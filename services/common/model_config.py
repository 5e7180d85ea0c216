"""Ouro model configuration, parsed from / written to the published HF ``config.json`` format.

Every field Hugging Face's Ouro code reads is either implemented here or refused with a
message naming it and its value; absent fields take the defaults of HF's ``OuroConfig``
(``configuration_ouro.py``). ``config_field_report`` says, field by field, which is which
(``rlt check-checkpoint`` prints it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common.config_error import ConfigError, load_json_file
from services.common.generation_config import (
    GENERATION_CONFIG_FILE,
    GENERATION_KEYS,
    GenerationDefaults,
)

__all__ = ["HF_DEFAULTS", "ConfigError", "OuroConfig", "config_field_report"]

CONFIG_FILE = "config.json"

# The model's shape. HF's OuroConfig would fall back to the Qwen-7B-like shape of its
# defaults (hidden_size 4096, ...), which fits no published Ouro checkpoint and fails its
# weight loading; rlt refuses up front, naming the field.
_REQUIRED_INT = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
_REQUIRED_NAMES = frozenset(_REQUIRED_INT)

# HF OuroConfig's defaults for the fields rlt takes from config.json when they are absent.
HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}

# Fields rlt reads and implements (or refuses when set to something it cannot run).
_IMPLEMENTED = frozenset(
    {
        *_REQUIRED_NAMES,
        *HF_DEFAULTS,
        "head_dim",
        "eos_token_id",
        "bos_token_id",
        "torch_dtype",
        "dtype",
        "model_type",
        "layer_types",
        "rope_scaling",
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
        "early_exit_step",
        "quantization_config",
        "pruned_heads",
    }
)
# Fields with no effect on an inference forward pass (HF's Ouro code reads them only for
# training, weight init, caching, loading or metadata).
_NO_EFFECT = {
    "architectures": "metadata",
    "auto_map": "the HF remote-code classes",
    "transformers_version": "metadata",
    "_name_or_path": "metadata",
    "attention_dropout": "dropout is off at inference",
    "initializer_range": "weight init for training",
    "use_cache": "HF's KV-cache switch; rlt always caches",
    "pad_token_id": "padding index of the embedding (training only)",
    "chunk_size": "read by HF's OuroForCausalLM but never used",
}


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

    # generation_config.json (eos ids, sampling defaults); empty unless read from a directory
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)

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
        for tok in (*self.eos_token_ids, *self.generation.eos_token_ids, self.bos_token_id):
            if tok is not None and not (0 <= tok < self.vocab_size):
                raise ConfigError(
                    f"special token id {tok} is outside the vocabulary (size {self.vocab_size})"
                )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: config.json's eos, then generation_config.json's."""
        return tuple(dict.fromkeys((*self.eos_token_ids, *self.generation.eos_token_ids)))

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
        _refuse_unsupported(d)

        def req_int(name: str) -> int:
            if name not in d:
                raise ConfigError(f"config is missing required field {name!r}")
            return _as_int(name, d[name])

        hidden = req_int("hidden_size")
        heads = req_int("num_attention_heads")
        vals: dict[str, Any] = {name: req_int(name) for name in _REQUIRED_INT}
        # HF: absent -> its default of 32; an explicit null -> num_attention_heads
        kv_heads = d.get("num_key_value_heads", HF_DEFAULTS["num_key_value_heads"])
        if "num_key_value_heads" not in d and heads % kv_heads != 0:
            raise ConfigError(
                f"config has no 'num_key_value_heads': HF's default of {kv_heads} does not "
                f"divide num_attention_heads ({heads}); the checkpoint needs the field"
            )
        vals["num_key_value_heads"] = _as_int(
            "num_key_value_heads", heads if kv_heads is None else kv_heads
        )
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else eos if isinstance(eos, list | tuple) else [eos]
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
        for name in ("rms_norm_eps", "rope_theta", "early_exit_threshold"):
            value = d.get(name)
            # a null threshold is HF's "no threshold": every loop, as 1.0 is here
            vals[name] = _as_float(name, HF_DEFAULTS[name] if value is None else value)
        vals["rope_theta"] = _rope_theta(d, vals["rope_theta"])
        for name in ("max_position_embeddings", "total_ut_steps"):
            vals[name] = _as_int(name, d.get(name, HF_DEFAULTS[name]))
        tie = d.get("tie_word_embeddings", HF_DEFAULTS["tie_word_embeddings"])
        if not isinstance(tie, bool):
            raise ConfigError(f"config field 'tie_word_embeddings' must be a bool, got {tie!r}")
        vals["tie_word_embeddings"] = tie
        dtype = d.get("torch_dtype", d.get("dtype")) or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"config field 'torch_dtype' is unsupported: {dtype!r}")
        vals["torch_dtype"] = dtype
        return cls(**vals)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> OuroConfig:
        """config.json plus generation_config.json of a checkpoint directory. Without a
        generation_config.json the generation keys come from config.json, as in HF."""
        ckpt = Path(checkpoint_dir)
        source = ckpt / GENERATION_CONFIG_FILE
        if source.is_file():
            cfg = cls.from_json_file(ckpt / CONFIG_FILE)
            generation = load_json_file(source, GenerationDefaults.from_dict)
        else:  # the sampling defaults config.json itself carries (read once for both)
            source = ckpt / CONFIG_FILE
            cfg, generation = load_json_file(
                source, lambda raw: (cls.from_dict(raw), GenerationDefaults.from_dict(raw))
            )
        try:
            return replace(cfg, generation=generation)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def from_json_file(cls, path: str | Path) -> OuroConfig:
        return load_json_file(Path(path), cls.from_dict)

    def to_hf_dict(self) -> dict[str, Any]:
        """The published HF Ouro config.json layout (field names exactly as HF uses them)."""
        eos: int | list[int] | None = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        if not self.eos_token_ids:
            eos = None
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
            "max_window_layers": HF_DEFAULTS["max_window_layers"],
            "vocab_size": self.vocab_size,
        }


def config_field_report(d: Mapping[str, Any]) -> dict[str, str]:
    """What rlt does with each field of a config.json dict: "implemented", "no effect: why",
    or "unknown: ..." (neither rlt nor HF's Ouro code reads it). Refused values raise in
    ``OuroConfig.from_dict``, not here."""
    report: dict[str, str] = {}
    for name in d:
        if name in _IMPLEMENTED:
            report[name] = "implemented"
        elif name in _NO_EFFECT:
            report[name] = f"no effect: {_NO_EFFECT[name]}"
        elif name in GENERATION_KEYS:
            report[name] = "generation default, used when there is no generation_config.json"
        else:
            report[name] = "unknown: not read by rlt (nor by HF's Ouro modeling code)"
    return report


def _refuse_unsupported(d: Mapping[str, Any]) -> None:
    """Raise ConfigError for any field whose value would make HF's Ouro compute something
    rlt does not."""
    model_type = d.get("model_type", "ouro")
    if model_type != "ouro":
        raise ConfigError(f"config field 'model_type' must be 'ouro', got {model_type!r}")
    act = d.get("hidden_act", HF_DEFAULTS["hidden_act"])
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act' must be 'silu', got {act!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ConfigError(
                f"config field {flag!r} is {d[flag]!r}: not supported (Ouro has no biases)"
            )
    for name in ("rope_scaling", "rope_parameters"):
        rope = d.get(name)
        if rope is None:
            continue
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else rope
        if kind not in (None, "default"):
            raise ConfigError(
                f"config field {name!r} is {rope!r}: only the default RoPE is supported"
            )
    if d.get("early_exit_step") is not None:
        raise ConfigError(
            f"config field 'early_exit_step' is {d['early_exit_step']!r}: a fixed exit step "
            "for every token is not supported as a checkpoint default (a request can set "
            "max_loops)"
        )
    if d.get("quantization_config"):
        raise ConfigError(
            "config field 'quantization_config' is set: quantized checkpoints are not supported"
        )
    if d.get("pruned_heads"):
        raise ConfigError(f"config field 'pruned_heads' is {d['pruned_heads']!r}: not supported")
    _refuse_sliding_window(d)


def _refuse_sliding_window(d: Mapping[str, Any]) -> None:
    """HF derives each layer's attention from these fields (``layer_types``, or sliding for
    layers >= ``max_window_layers`` when ``use_sliding_window`` and ``sliding_window`` are
    set). No published Ouro checkpoint uses a window and rlt does not implement one, so any
    layer that would get one is refused; windows that reach no layer are accepted."""
    use = d.get("use_sliding_window", HF_DEFAULTS["use_sliding_window"])
    window = d.get("sliding_window", HF_DEFAULTS["sliding_window"]) if use else None
    layers = d.get("num_hidden_layers")
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or any(
            t not in ("full_attention", "sliding_attention") for t in types
        ):
            raise ConfigError(f"config field 'layer_types' is invalid: {types!r}")
        if isinstance(layers, int) and len(types) != layers:
            raise ConfigError(
                f"config field 'layer_types' has {len(types)} entries for {layers} layers"
            )
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if sliding:
            raise ConfigError(
                f"config field 'layer_types' makes layers {sliding} sliding_attention "
                f"(sliding_window={window!r}): sliding-window attention is not supported"
            )
        return
    if window is None or not isinstance(layers, int):
        return
    first = _as_int(
        "max_window_layers", d.get("max_window_layers", HF_DEFAULTS["max_window_layers"])
    )
    if first < layers:
        raise ConfigError(
            f"config field 'use_sliding_window' is true with sliding_window={window!r} and "
            f"max_window_layers={first}: layers {first}..{layers - 1} would use "
            "sliding-window attention, which no published Ouro checkpoint uses and rlt does "
            "not implement"
        )


def _rope_theta(d: Mapping[str, Any], theta: float) -> float:
    """transformers v5 may save ``rope_theta`` inside ``rope_parameters``."""
    params = d.get("rope_parameters")
    if not isinstance(params, Mapping) or params.get("rope_theta") is None:
        return theta
    nested = _as_float("rope_parameters.rope_theta", params["rope_theta"])
    if d.get("rope_theta") is not None and nested != theta:
        raise ConfigError(
            f"config fields 'rope_theta' ({theta}) and 'rope_parameters.rope_theta' "
            f"({nested}) disagree"
        )
    return nested


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
