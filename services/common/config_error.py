"""The error every checkpoint-file parser raises (config.json, generation_config.json,
tokenizer files): the message names the file, the field and the value."""

from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint file is missing a required field or holds a value rlt refuses."""
