"""The early-exit rule of DESIGN.md §1, in one place.

The worker evaluates it inline (so an exited row goes to the coda in the same pass);
the rule itself is this pure function of the request's parameters and survival state.
Survival arithmetic is float32, exactly as the oracle does it.
"""

from __future__ import annotations

import torch


def update_survival(remaining: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """remaining *= 1 - sigmoid(gate), elementwise in float32 (applied on every loop)."""
    hazard = torch.sigmoid(gate_logits.to(torch.float32))
    return remaining.to(torch.float32) * (1.0 - hazard)


def should_exit(
    loops_run: int, remaining: float, min_loops: int, max_loops: int, threshold: float
) -> bool:
    """Exit after ``loops_run`` loops? ``remaining`` is the float32 survival after them."""
    if loops_run >= max_loops:
        return True
    if threshold >= 1.0 or loops_run < min_loops:
        return False
    cdf = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(remaining, dtype=torch.float32)
    return bool(cdf >= torch.tensor(threshold, dtype=torch.float32))
