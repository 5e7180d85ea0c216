"""The exit rule of one token, evaluated on its own in float32, as the oracle runs it."""

from __future__ import annotations

import math

import torch


class ExitTracker:
    """Per-token exit policy state, evaluated exactly in float32.

    After loop r: ``λ_r = sigmoid(gate_logit)``; ``remaining *= 1 - λ_r`` (on every loop, also
    below ``min_loops``); ``cdf = 1 - remaining``. Exit when ``r >= max_loops`` or when
    ``threshold < 1 and r >= min_loops and cdf >= threshold``. The comparison is done in
    float32 (the threshold is rounded to float32), as a tensor comparison on device would.
    """

    def __init__(self, min_loops: int, max_loops: int, threshold: float) -> None:
        self.min_loops = min_loops
        self.max_loops = max_loops
        self.threshold = threshold
        self._threshold_f32 = torch.tensor(threshold, dtype=torch.float32)
        self.remaining = torch.tensor(1.0, dtype=torch.float32)
        self.loops = 0
        self.margin = math.inf

    @property
    def cdf(self) -> torch.Tensor:
        return (1.0 - self.remaining).to(torch.float32)

    def observe(self, gate_logit: torch.Tensor | float) -> bool:
        """Account for one finished loop given its gate logit; return True to exit now."""
        logit = torch.as_tensor(gate_logit, dtype=torch.float32).reshape(())
        return self.observe_hazard(torch.sigmoid(logit))

    def observe_hazard(self, hazard: torch.Tensor | float) -> bool:
        """Like :meth:`observe` but with the hazard λ_r given directly."""
        lam = torch.as_tensor(hazard, dtype=torch.float32).reshape(())
        self.loops += 1
        # Each op on float32 0-d tensors rounds to float32, matching a float32 device kernel.
        self.remaining = (self.remaining * (1.0 - lam)).to(torch.float32)
        r = self.loops
        if r >= self.max_loops:
            return True
        if self.threshold < 1.0 and r >= self.min_loops:
            cdf = self.cdf
            self.margin = min(self.margin, abs(float(cdf) - self.threshold))
            return bool(cdf >= self._threshold_f32)
        return False
