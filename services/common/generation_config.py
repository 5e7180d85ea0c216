"""A checkpoint's ``generation_config.json``: its end-of-sequence ids and sampling defaults.

Hugging Face's ``generate()`` stops at the generation config's ``eos_token_id`` (an int or a
list); vLLM (``--generation-config auto``) also takes its sampling values as the defaults of
requests that do not set them. rlt does both: the eos ids join config.json's, and
``temperature``, ``top_p``, ``top_k`` and ``max_new_tokens`` (as ``max_tokens``) become the
request defaults. A request's own values always win.

Keys that change sampling in a way rlt cannot (``repetition_penalty``, ``min_p``, ...) are
not applied; they are listed in ``not_applied`` so ``rlt check-checkpoint`` and the load log
can say so. ``do_sample`` is not read, as in vLLM: ``temperature`` alone decides greedy (0)
or sampling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.config_error import ConfigError

GENERATION_CONFIG_FILE = "generation_config.json"

# Sampling keys of HF's GenerationConfig that rlt has no equivalent for, with the value that
# makes each one a no-op (a file that holds that value changes nothing).
_NOT_IMPLEMENTED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,
    "min_new_tokens": None,
    "min_length": 0,
}


# every key GenerationDefaults reads or reports
GENERATION_KEYS = frozenset(
    {"eos_token_id", "max_new_tokens", "temperature", "top_p", "top_k", *_NOT_IMPLEMENTED}
)


@dataclass(frozen=True)
class GenerationDefaults:
    """The parts of generation_config.json rlt applies (``None``: the file does not say)."""

    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # "key=value" of sampling keys present with an effect rlt does not implement
    not_applied: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GenerationDefaults:
        if not isinstance(d, Mapping):
            raise ConfigError(f"generation config must be a JSON object, got {type(d).__name__}")
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
        eos_ids = tuple(_nonneg_int("eos_token_id", e) for e in eos_list)
        max_new = d.get("max_new_tokens")
        temperature = _opt_number("temperature", d.get("temperature"))
        if temperature is not None and temperature < 0:
            raise ConfigError(
                f"generation config field 'temperature' must be >= 0, got {temperature}"
            )
        top_p = _opt_number("top_p", d.get("top_p"))
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ConfigError(f"generation config field 'top_p' must be in (0, 1], got {top_p}")
        top_k = d.get("top_k")
        not_applied = tuple(
            f"{key}={d[key]!r}"
            for key, neutral in _NOT_IMPLEMENTED.items()
            if key in d and d[key] != neutral
        )
        return cls(
            eos_token_ids=eos_ids,
            max_tokens=None if max_new is None else _positive_int("max_new_tokens", max_new),
            temperature=temperature,
            top_p=top_p,
            top_k=None if top_k is None else _nonneg_int("top_k", top_k),
            not_applied=not_applied,
        )


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"generation config field {name!r} must be an int >= 0, got {value!r}")
    return value


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"generation config field {name!r} must be an int >= 1, got {value!r}")
    return value


def _opt_number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"generation config field {name!r} must be a number, got {value!r}")
    return float(value)
