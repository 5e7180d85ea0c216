"""Held-out loss, next-token accuracy and early-loop agreement at each fixed depth.

Teacher-forced over whole windows: every position runs d loops (its history too), as the
model was trained; ``rlt eval`` checks that depth D equals the oracle's prompt logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.train.model import LoopedLM


@dataclass(frozen=True)
class DepthRow:
    loops: int
    loss: float  # mean next-token cross-entropy, nats
    accuracy: float  # greedy next token == the held-out token
    agrees_with_final: float  # greedy token after `loops` == greedy token after all loops


@torch.no_grad()
def fixed_depth_table(model: LoopedLM, windows: list[torch.Tensor]) -> list[DepthRow]:
    loops = model.cfg.total_ut_steps
    loss = torch.zeros(loops, dtype=torch.float64)
    correct = torch.zeros(loops, dtype=torch.float64)
    agree = torch.zeros(loops, dtype=torch.float64)
    count = 0
    for w in windows:
        ids, targets = w[None, :-1], w[1:]
        out = model.loops(ids)
        greedy = [model.logits(h)[0].argmax(-1) for h in out.hidden]
        for d, h in enumerate(out.hidden):
            logits = model.logits(h)[0].float()
            loss[d] += F.cross_entropy(logits, targets, reduction="sum").double()
            correct[d] += (greedy[d] == targets).sum()
            agree[d] += (greedy[d] == greedy[-1]).sum()
        count += targets.numel()
    return [
        DepthRow(d + 1, float(loss[d] / count), float(correct[d] / count), float(agree[d] / count))
        for d in range(loops)
    ]
