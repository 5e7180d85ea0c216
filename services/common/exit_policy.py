"""The early-exit rule of DESIGN.md §1, in one place.

The worker evaluates it inline (so an exited row goes to the coda in the same pass);
the rule itself is this pure function of the request's parameters and survival state.
Survival arithmetic is float32, exactly as the oracle does it.
"""

from __future__ import annotations

import struct

import torch


def update_survival(remaining: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """remaining *= 1 - sigmoid(gate), elementwise in float32 (applied on every loop)."""
    hazard = torch.sigmoid(gate_logits.to(torch.float32))
    return remaining.to(torch.float32) * (1.0 - hazard)


_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even), as a Python float."""
    return _F32.unpack(_F32.pack(x))[0]


def should_exit(
    loops_run: int, remaining: float, min_loops: int, max_loops: int, threshold: float
) -> bool:
    """Exit after ``loops_run`` loops? ``remaining`` is the float32 survival after them.

    The test ``1 - remaining >= threshold`` is float32 arithmetic, as the oracle's tensor
    comparison is, done on Python floats: called per decode row per pass, it must not
    build tensors (that cost ~10 us a call).
    """
    if loops_run >= max_loops:
        return True
    if threshold >= 1.0 or loops_run < min_loops:
        return False
    # remaining is a float32 value, so the float64 difference is exact unless remaining
    # < 2**-29, where it and the float32 difference both round to 1.0: one rounding to
    # float32 gives exactly the float32 subtraction
    return _f32(1.0 - _f32(remaining)) >= _f32(threshold)
