"""The exit rule of DESIGN.md §1 as the worker applies it (float32 survival arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from services.common.exit_policy import should_exit, update_survival

pytestmark = pytest.mark.unit


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def run_policy(
    hazard: float, *, min_loops: int, max_loops: int, threshold: float, gate: float | None = None
) -> tuple[int, list[float]]:
    remaining = torch.tensor([1.0], dtype=torch.float32)
    g = torch.tensor([logit(hazard) if gate is None else gate], dtype=torch.float32)
    cdfs: list[float] = []
    for r in range(1, max_loops + 1):
        remaining = update_survival(remaining, g)
        cdfs.append(1.0 - remaining.item())
        if should_exit(r, remaining.item(), min_loops, max_loops, threshold):
            return r, cdfs
    raise AssertionError("policy never exited")


def test_constant_hazard_cdf_sequence() -> None:
    _, cdfs = run_policy(0.4, min_loops=1, max_loops=4, threshold=1.0)
    assert cdfs[:3] == pytest.approx([0.4, 0.64, 0.784], abs=1e-6)


def test_threshold_exits_at_first_loop_reaching_it() -> None:
    assert run_policy(0.4, min_loops=1, max_loops=4, threshold=0.6)[0] == 2


def test_min_loops_delays_exit() -> None:
    assert run_policy(0.4, min_loops=3, max_loops=4, threshold=0.5)[0] == 3


def test_max_loops_caps_depth() -> None:
    assert run_policy(0.01, min_loops=1, max_loops=2, threshold=0.9)[0] == 2


def test_threshold_one_never_exits_early_even_when_sigmoid_rounds_to_one() -> None:
    assert torch.sigmoid(torch.tensor(100.0)).item() == 1.0
    depth, cdfs = run_policy(0.5, min_loops=1, max_loops=4, threshold=1.0, gate=100.0)
    assert depth == 4 and cdfs[0] == 1.0


def test_threshold_zero_exits_at_min_loops() -> None:
    assert run_policy(0.01, min_loops=2, max_loops=4, threshold=0.0)[0] == 2


def test_survival_is_updated_below_min_loops_too() -> None:
    # hazard 0.4 on loops 1 and 2 (below min_loops 3) still counts: cdf after loop 3 = 0.784
    assert run_policy(0.4, min_loops=3, max_loops=4, threshold=0.78)[0] == 3


def tensor_rule(remaining: float, threshold: float) -> bool:
    """The float32 tensor comparison the oracle makes (DESIGN.md §1)."""
    one = torch.tensor(1.0, dtype=torch.float32)
    cdf = one - torch.tensor(remaining, dtype=torch.float32)
    return bool(cdf >= torch.tensor(threshold, dtype=torch.float32))


@given(
    remaining=st.floats(0.0, 1.0, width=32),
    threshold=st.floats(0.0, 1.0, exclude_max=True),
)
def test_float_rule_equals_the_float32_tensor_rule(remaining: float, threshold: float) -> None:
    # should_exit runs per decode row per pass, so it uses Python floats; it must decide
    # exactly as float32 tensors do, ties and roundings included
    assert should_exit(1, remaining, 1, 4, threshold) == tensor_rule(remaining, threshold)


def test_float_rule_at_the_threshold_boundary() -> None:
    # survivals one float32 step either side of 1 - threshold, where rounding decides
    for threshold in (0.7, 0.5, 0.1, 0.9999, 1e-9, 0.3333333333):
        edge = torch.tensor(1.0 - threshold, dtype=torch.float32)
        for r in (
            torch.nextafter(edge, torch.tensor(0.0)),
            edge,
            torch.nextafter(edge, torch.tensor(1.0)),
        ):
            assert should_exit(2, r.item(), 1, 4, threshold) == tensor_rule(r.item(), threshold)
    for tiny in (0.0, 1e-45, 2.0**-30, 2.0**-25, 2.0**-24):
        assert should_exit(2, tiny, 1, 4, 0.999999) == tensor_rule(tiny, 0.999999)
