"""What the serial oracle returns (an ``OracleStep`` per token, one ``OracleResult``) and the
token-sparse prefill setting it takes (``SparseSetting``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class OracleStep:
    """Diagnostics for one generated token."""

    token_id: int
    exit_depth: int
    # logits[top1] - logits[top2] of the logits this token was chosen from; lets tests tell a
    # real mismatch from a near-tie that float reordering may legitimately flip.
    top2_gap: float
    # min |cdf - threshold| over the loops where the threshold test was evaluated; +inf if
    # none. Small values flag exits that rounding differences could move.
    threshold_margin: float
    # log_softmax of those logits (float32): the token's own, and the 20 most likely
    # (id, log-probability), most likely first
    logprob: float = 0.0
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class OracleResult:
    token_ids: list[int]
    exit_depths: list[int]
    finish_reason: str
    steps: list[OracleStep] = field(default_factory=list)
    # token-sparse prefill: the smallest score gap between the last token a window kept and
    # the best one it froze (+inf if none); a tiny gap flags a choice rounding could flip
    selection_margin: float = math.inf


@dataclass(frozen=True)
class SparseSetting:
    """Token-sparse prefill for ``SerialOracle.generate``: windows of ``window`` prompt
    tokens, ``retention`` one share per loop (the first 1)."""

    window: int
    retention: tuple[float, ...]
