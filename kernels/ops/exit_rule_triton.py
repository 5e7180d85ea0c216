"""Triton kernel of ``rlt::exit_rule``: one program per block of decode rows."""

from __future__ import annotations

import torch
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


def exit_rule(
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
