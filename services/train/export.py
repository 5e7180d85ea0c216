"""Writes a trained model as an Ouro checkpoint in Hugging Face's format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from services.worker.model.loader import CONFIG_FILE
from services.worker.model.toy import save_weights, write_tokenizer_files

from .model import LoopedLM

TRAINING_FILE = "training.json"


def export_checkpoint(
    model: LoopedLM, tokenizer_json: str, out: Path, training: dict[str, Any]
) -> Path:
    """Weights, tokenizer files, ``training.json`` (the settings, the corpus split and the
    log, so ``rlt eval`` rebuilds the same held-out split) and config.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / TRAINING_FILE).write_text(json.dumps(training, indent=2) + "\n")
    cfg = model.cfg
    weights = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_weights(iter(weights.items()), out, shard_bytes=1 << 40)
    write_tokenizer_files(out, Tokenizer.from_str(tokenizer_json), cfg)
    # config.json last: callers that cache checkpoints treat it as "the write finished"
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return out
