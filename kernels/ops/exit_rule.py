"""The early-exit rule (DESIGN.md §1) on the device, for every decode row of a pass at once.

``remaining *= 1 - sigmoid(gate)`` in float32, then a row exits when it reached its
``max_loops``, or when its threshold is below 1, it ran at least ``min_loops`` and
``1 - remaining >= threshold``; a row with ``forced > 0`` exits exactly after that many
loops instead (a replayed exit). The reference is the host rule of
``services.common.exit_policy`` written with tensors (the same float32 operations in the same
order), so the two agree bit for bit; the Triton kernel does it in one launch on CUDA.
"""

from __future__ import annotations

import torch
from torch.library import Library

from kernels.ops._triton import triton_available

_lib = Library("rlt", "FRAGMENT")
_lib.define(
    "exit_rule(Tensor gate_logits, Tensor remaining, Tensor loops_run, Tensor min_loops, "
    "Tensor max_loops, Tensor threshold, Tensor forced) -> (Tensor, Tensor)"
)


def exit_rule_reference(
    gate_logits: torch.Tensor,
    remaining: torch.Tensor,
    loops_run: torch.Tensor,
    min_loops: torch.Tensor,
    max_loops: torch.Tensor,
    threshold: torch.Tensor,
    forced: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    hazard = torch.sigmoid(gate_logits.to(torch.float32))
    survived = remaining.to(torch.float32) * (1.0 - hazard)
    reached = (1.0 - survived) >= threshold
    policy = (loops_run >= max_loops) | ((threshold < 1.0) & (loops_run >= min_loops) & reached)
    exited = torch.where(forced > 0, loops_run >= forced, policy)
    return survived, exited


def _exit_rule_fake(gate_logits: torch.Tensor, *rest: torch.Tensor):
    n = gate_logits.shape[0]
    return (
        gate_logits.new_empty(n, dtype=torch.float32),
        gate_logits.new_empty(n, dtype=torch.bool),
    )


_lib.impl("exit_rule", exit_rule_reference, "CPU")
torch.library.register_fake("rlt::exit_rule", _exit_rule_fake, lib=_lib)


def exit_rule_triton(
    gate_logits: torch.Tensor,
    remaining: torch.Tensor,
    loops_run: torch.Tensor,
    min_loops: torch.Tensor,
    max_loops: torch.Tensor,
    threshold: torch.Tensor,
    forced: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1)."""
    from kernels.ops import exit_rule_triton

    return exit_rule_triton.exit_rule(
        gate_logits, remaining, loops_run, min_loops, max_loops, threshold, forced
    )


def _exit_rule_cuda(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_available():
        return exit_rule_triton(*args)
    return exit_rule_reference(*args)  # several launches instead of one


_lib.impl("exit_rule", _exit_rule_cuda, "CUDA")
_exit_rule_op = torch.ops.rlt.exit_rule.default


def exit_rule(
    gate_logits: torch.Tensor,
    remaining: torch.Tensor,
    loops_run: torch.Tensor,
    min_loops: torch.Tensor,
    max_loops: torch.Tensor,
    threshold: torch.Tensor,
    forced: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per decode row: (float32 survival after this loop, whether the row exits now).
    ``gate_logits``, ``remaining``, ``threshold``: float32 [N]; the loop counts int32 [N]."""
    return _exit_rule_op(gate_logits, remaining, loops_run, min_loops, max_loops, threshold, forced)
