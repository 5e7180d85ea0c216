"""The held-out token windows a checkpoint was never trained on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.common.tokenizer import TextCodec
from services.train.corpus import build_corpus
from services.train.export import TRAINING_FILE


def held_out_stream(checkpoint: Path) -> torch.Tensor:
    """The held-out documents of the checkpoint's training run, tokenized with its own
    tokenizer and separated by <|endoftext|> (id 0), as training streamed them."""
    training = json.loads((checkpoint / TRAINING_FILE).read_text())
    settings, corpus = training["settings"], training["corpus"]
    split = build_corpus(settings["seed"], corpus["held_out_share"])
    codec = TextCodec.from_checkpoint(checkpoint)
    ids: list[int] = []
    for doc in split.held_out:
        ids.extend(codec.encode(doc.text))
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens spread evenly over the stream."""
    stride = (stream.numel() - length) // max(1, count)
    if stride < 1:
        raise ValueError(f"the held-out stream ({stream.numel()} tokens) is too short")
    return [stream[i * stride : i * stride + length] for i in range(count)]
