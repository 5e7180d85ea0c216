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

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _exit_rule_kernel(
        gate_ptr,
        remaining_ptr,
        loops_ptr,
        min_ptr,
        max_ptr,
        threshold_ptr,
        forced_ptr,
        survived_ptr,
        exited_ptr,
        n,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rem = tl.load(remaining_ptr + offs, mask=mask, other=1.0).to(tl.float32)
        loops = tl.load(loops_ptr + offs, mask=mask, other=0)
        lo = tl.load(min_ptr + offs, mask=mask, other=0)
        hi = tl.load(max_ptr + offs, mask=mask, other=0)
        thr = tl.load(threshold_ptr + offs, mask=mask, other=1.0)
        forced = tl.load(forced_ptr + offs, mask=mask, other=0)
        hazard = 1.0 / (1.0 + tl.exp(-gate))
        survived = rem * (1.0 - hazard)
        reached = (1.0 - survived) >= thr
        policy = (loops >= hi) | ((thr < 1.0) & (loops >= lo) & reached)
        exited = tl.where(forced > 0, loops >= forced, policy)
        tl.store(survived_ptr + offs, survived, mask=mask)
        tl.store(exited_ptr + offs, exited.to(tl.int8), mask=mask)

    def exit_rule_triton(
        gate_logits: torch.Tensor,
        remaining: torch.Tensor,
        loops_run: torch.Tensor,
        min_loops: torch.Tensor,
        max_loops: torch.Tensor,
        threshold: torch.Tensor,
        forced: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = gate_logits.shape[0]
        survived = torch.empty(n, dtype=torch.float32, device=gate_logits.device)
        exited = torch.empty(n, dtype=torch.bool, device=gate_logits.device)
        if n:
            block = 128
            _exit_rule_kernel[(triton.cdiv(n, block),)](
                gate_logits.contiguous(),
                remaining.contiguous(),
                loops_run.contiguous(),
                min_loops.contiguous(),
                max_loops.contiguous(),
                threshold.contiguous(),
                forced.contiguous(),
                survived,
                exited.view(torch.int8),
                n,
                BLOCK=block,
            )
        return survived, exited

    _lib.impl("exit_rule", exit_rule_triton, "CUDA")
else:  # without triton CUDA runs the reference (several launches instead of one)
    _lib.impl("exit_rule", exit_rule_reference, "CUDA")


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
    return torch.ops.rlt.exit_rule.default(
        gate_logits, remaining, loops_run, min_loops, max_loops, threshold, forced
    )
