"""Log-probabilities as the worker reports them (vLLM's conventions): over the raw logits,
before temperature and top-k/top-p, floored at ``LOGPROB_FLOOR``."""

from __future__ import annotations

import torch

# the least log-probability reported (vLLM's floor): -inf and NaN have no JSON form
LOGPROB_FLOOR = -9999.0

# per row: the chosen token's log-probability, the best ids and their log-probabilities
Scored = tuple[float, list[int], list[float]]


def logprob_columns(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> torch.Tensor:
    """Per row of ``logits`` [N, V], on the device: float32 [N, 1 + 2 * top] holding the
    chosen token's log-probability, the ``top`` best log-probabilities, then their ids
    (exact in float32 below 2**24, far above any vocabulary). One batched log-softmax; a
    row with an infinite logit has no finite distribution, so values are floored."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)
    columns = [logprobs.gather(1, chosen.long()[:, None])]
    k = min(top, logprobs.shape[-1])
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        columns += [values, ids]
    return torch.cat([c.float() for c in columns], dim=1)


def read_scored(host_rows: list[list[float]], top: int) -> list[Scored]:
    """``logprob_columns`` rows, copied to the host, as (chosen, top ids, top values)."""
    return [(r[0], [int(t) for t in r[1 + top :]], r[1 : 1 + top]) for r in host_rows]
