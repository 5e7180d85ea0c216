"""Checkpoint facts the CPU-only services need (admission, scheduler): model limits from
config.json and generation_config.json, without loading any weights (the tokenizer is
services/common/tokenizer.py's TextCodec)."""

from __future__ import annotations

from pathlib import Path

import structlog

from services.common.config import ModelLimits
from services.common.model_config import OuroConfig


def load_model_limits(checkpoint: str | Path) -> ModelLimits:
    """From config.json and generation_config.json; says once in the log when no file
    names an end-of-sequence token."""
    cfg = OuroConfig.from_checkpoint(checkpoint)
    log_checkpoint_notes(cfg, checkpoint)
    return ModelLimits.from_model_config(cfg)


def log_checkpoint_notes(cfg: OuroConfig, checkpoint: str | Path) -> None:
    """Says once, when a checkpoint is loaded, what of it rlt runs differently from what a
    user might expect: no eos at all, or generation_config.json keys it does not apply."""
    log = structlog.get_logger("rlt.checkpoint")
    if not cfg.stop_token_ids:
        log.warning(
            "checkpoint names no eos_token_id (config.json, generation_config.json): "
            "requests end only at max_tokens or their stop_token_ids",
            checkpoint=str(checkpoint),
        )
    if cfg.generation.not_applied:
        log.warning(
            "generation_config.json keys not applied (rlt has no such sampling option)",
            keys=list(cfg.generation.not_applied),
            checkpoint=str(checkpoint),
        )
