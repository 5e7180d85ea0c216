"""Token-sparse windows' active tokens, chosen on the device for many windows at once, with
no host wait: the same choice as ``sparse_prefill.choose_active`` (the prompt's last
position if a candidate, then the highest scores, equal scores to the lower position; NaN
scores last), as a few sorts whose sizes the host knows, so nothing reads a device value
to size a result."""

from __future__ import annotations

import torch


def choose_on_device(
    candidates: torch.Tensor,
    window_of: torch.Tensor,
    first: torch.Tensor,
    scores: torch.Tensor,
    counts: torch.Tensor,
    forced: torch.Tensor,
    total: int,
    span: int,
) -> torch.Tensor:
    """The chosen positions, window by window, ascending within each.

    ``candidates`` [N] int64: every window's candidate positions, ascending, windows one
    after the other; ``window_of`` [N]: each candidate's window (0.., non-decreasing);
    ``first`` [W]: where each window's candidates start; ``scores`` [N] float32: each
    candidate's score; ``counts`` [W]: tokens each window keeps; ``forced`` [W]: the
    position each window must keep (-1: none); ``total``: the sum of ``counts`` (known on
    the host); ``span``: above every position."""
    if candidates.numel() == 0 or total == 0:
        return candidates[:0]
    key = torch.where(torch.isnan(scores), float("-inf"), scores)
    key = torch.where(candidates == forced[window_of], float("inf"), key)
    # best first within each window: stable sorts keep equal scores in position order
    order = torch.sort(key, descending=True, stable=True).indices
    order = order[torch.sort(window_of[order], stable=True).indices]
    window = window_of[order]
    rank = torch.arange(order.numel(), device=order.device) - first[window]
    kept = rank < counts[window]
    # the kept ones by (window, position), the rest after them: the first ``total``
    position = candidates[order]
    rest = (counts.numel() + 1) * span
    by_window = torch.where(kept, window * span + position, torch.full_like(position, rest))
    return position[torch.sort(by_window).indices[:total]]
