"""The exit-threshold curve: mean loops per generated token against held-out loss.

Every point scores the same held-out continuations through the oracle (teacher-forced,
``teacher_forcing.py``); threshold 1.0 is fixed depth, the reference of every ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.oracle import SerialOracle

from .teacher_forcing import score_continuation


@dataclass(frozen=True)
class ExitPoint:
    threshold: float
    min_loops: int
    mean_loops: float  # over decode tokens (the first token always runs the full prefill)
    loss: float
    loops_ratio: float  # mean_loops / the fixed depth's
    loss_ratio: float  # loss / the fixed depth's


def exit_sweep(
    oracle: SerialOracle,
    windows: list[torch.Tensor],
    prompt_len: int,
    thresholds: list[float],
    min_loops: int,
) -> list[ExitPoint]:
    raw: list[tuple[float, float, float]] = []
    for threshold in [1.0, *[t for t in thresholds if t < 1.0]]:
        nll: list[float] = []
        depths: list[int] = []
        for w in windows:
            scored = score_continuation(
                oracle, w, prompt_len, min_loops=min_loops, exit_threshold=threshold
            )
            nll.extend(scored.nll[1:])
            depths.extend(scored.exit_depths[1:])
        raw.append((threshold, sum(depths) / len(depths), sum(nll) / len(nll)))
    _, fixed_loops, fixed_loss = raw[0]
    return [
        ExitPoint(t, min_loops, loops, loss, loops / fixed_loops, loss / fixed_loss)
        for t, loops, loss in raw
    ]


def best_saving(points: list[ExitPoint], max_loss_ratio: float) -> ExitPoint | None:
    """The point with the fewest loops whose loss stays within ``max_loss_ratio``."""
    within = [p for p in points if p.loss_ratio <= max_loss_ratio]
    return min(within, key=lambda p: p.loops_ratio) if within else None
