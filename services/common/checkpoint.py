"""Checkpoint facts the CPU-only services need (admission, scheduler): model limits from
config.json and the tokenizer, without loading any weights."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from services.common.config import ModelLimits
from services.common.model_config import OuroConfig

TOKENIZER_FILE = "tokenizer.json"


def load_model_limits(checkpoint: str | Path) -> ModelLimits:
    return ModelLimits.from_model_config(
        OuroConfig.from_json_file(Path(checkpoint) / "config.json")
    )


def load_tokenizer(checkpoint: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, or None (then only prompt_token_ids are accepted)."""
    path = Path(checkpoint) / TOKENIZER_FILE
    return Tokenizer.from_file(str(path)) if path.exists() else None
