"""The error every checkpoint-file parser raises (config.json, generation_config.json,
tokenizer files): the message names the file, the field and the value."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A checkpoint file is missing a required field or holds a value rlt refuses."""


def load_json_file(path: Path, parse: Callable[[Any], T]) -> T:
    """``parse`` of the JSON in ``path``; every error names the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: config file not found") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from e
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
