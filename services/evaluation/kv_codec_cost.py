"""The KV codecs' cost in quality: a held-out continuation scored through the oracle with
each codec (its own independent implementation of them), against ``auto``; int4-delta once
per anchor interval asked for (0: plane 0 the only anchor)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.kv_codec import AUTO, CODECS, INT4_DELTA, codec_name
from services.oracle import SerialOracle

from .teacher_forcing import score_continuation


@dataclass(frozen=True)
class CodecRow:
    codec: str  # the kv-cache-dtype, int4-delta's anchor interval beside it
    loss: float  # teacher-forced continuation loss, nats
    loss_ratio: float  # against auto
    greedy_agreement: float  # positions whose greedy token equals auto's
    anchor_every: int = 0  # int4-delta only


def kv_codec_cost(
    oracle: SerialOracle,
    windows: list[torch.Tensor],
    prompt_len: int,
    anchor_intervals: Sequence[int] = (0,),
) -> list[CodecRow]:
    variants = [(c, a) for c in CODECS for a in (anchor_intervals if c == INT4_DELTA else (0,))]
    scored = {
        (codec, every): [
            score_continuation(
                oracle, w, prompt_len, kv_cache_dtype=codec, kv_int4_anchor_every=every
            )
            for w in windows
        ]
        for codec, every in variants
    }
    base = scored[(AUTO, 0)]
    base_loss = _mean([x for s in base for x in s.nll])
    rows = []
    for (codec, every), runs in scored.items():
        loss = _mean([x for s in runs for x in s.nll])
        same = sum(
            a == b
            for s, r in zip(runs, base, strict=True)
            for a, b in zip(s.greedy, r.greedy, strict=True)
        )
        total = sum(len(r.greedy) for r in base)
        label = codec_name(codec, every, oracle.total_ut_steps)
        rows.append(CodecRow(label, loss, loss / base_loss, same / total, every))
    return rows


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
