"""The KV codecs' cost in quality: a held-out continuation scored through the oracle with
each codec (its own independent implementation of them), against ``auto``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_codec import AUTO, CODECS
from services.oracle import SerialOracle

from .teacher_forcing import score_continuation


@dataclass(frozen=True)
class CodecRow:
    codec: str
    loss: float  # teacher-forced continuation loss, nats
    loss_ratio: float  # against auto
    greedy_agreement: float  # positions whose greedy token equals auto's


def kv_codec_cost(
    oracle: SerialOracle, windows: list[torch.Tensor], prompt_len: int
) -> list[CodecRow]:
    scored = {
        codec: [score_continuation(oracle, w, prompt_len, kv_cache_dtype=codec) for w in windows]
        for codec in CODECS
    }
    base = scored[AUTO]
    base_loss = _mean([x for s in base for x in s.nll])
    rows = []
    for codec, runs in scored.items():
        loss = _mean([x for s in runs for x in s.nll])
        same = sum(
            a == b
            for s, r in zip(runs, base, strict=True)
            for a, b in zip(s.greedy, r.greedy, strict=True)
        )
        total = sum(len(r.greedy) for r in base)
        rows.append(CodecRow(codec, loss, loss / base_loss, same / total))
    return rows


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
