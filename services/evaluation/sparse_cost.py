"""Token-sparse prefill's cost in quality: the held-out continuation's loss and the first
token's agreement when the prompt was prefilled sparsely, against dense prefill."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.oracle import SerialOracle, SparseSetting

from .teacher_forcing import score_continuation


@dataclass(frozen=True)
class SparseRow:
    retention: tuple[float, ...] | None  # None: dense
    window: int | None
    rows_per_prompt_token: float  # loops run per prompt token / the model's loops
    continuation_loss: float
    loss_ratio: float  # against dense
    first_token_agreement: float  # greedy first token == dense's


def sparse_cost(
    oracle: SerialOracle,
    windows: list[torch.Tensor],
    prompt_len: int,
    settings: list[tuple[tuple[float, ...], int]],
) -> list[SparseRow]:
    loops = oracle.total_ut_steps
    dense = [score_continuation(oracle, w, prompt_len) for w in windows]
    dense_loss = _mean([x for s in dense for x in s.nll])
    rows = [SparseRow(None, None, 1.0, dense_loss, 1.0, 1.0)]
    for retention, window in settings:
        setting = SparseSetting(window=window, retention=retention)
        runs = [score_continuation(oracle, w, prompt_len, sparse=setting) for w in windows]
        loss = _mean([x for s in runs for x in s.nll])
        agree = sum(s.first_greedy == d.first_greedy for s, d in zip(runs, dense, strict=True))
        rows.append(
            SparseRow(
                retention,
                window,
                _rows_share(retention, window, prompt_len) / loops,
                loss,
                loss / dense_loss,
                agree / len(windows),
            )
        )
    return rows


def _rows_share(retention: tuple[float, ...], window: int, prompt_len: int) -> float:
    """Loops run per prompt token under the nested ceil rule (the scheduler's charge)."""
    total = 0
    for start in range(0, prompt_len, window):
        size = min(window, prompt_len - start)
        kept = size
        for r in retention:
            kept = min(max(1, math.ceil(size * r)), kept)
            total += kept
    return total / prompt_len


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
