"""Ouro's two training objectives for the exit gate, per token.

Stage 1 (the model and the gate together): the expected next-token loss over the exit
distribution, minus an entropy bonus that keeps every loop in use:
    p_t = lambda_t * prod_{j<t} (1 - lambda_j)   (the last loop takes what remains)
    L = sum_t p_t * loss_t - beta * H(p)
Stage 2 (the gate alone, the model frozen): each loop's hazard is taught whether the next
loop still pays: the label to continue after loop t is sigmoid(k * (loss_t - loss_{t+1} -
gamma)), a soft "the next loop improves the loss by more than gamma", and the gate's hazard
is fit to one minus it with binary cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_loop_token_loss(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """[loops, B, T] cross-entropy of each loop's logits against the next tokens."""
    return torch.stack(
        [
            F.cross_entropy(lg.flatten(0, 1).float(), targets.flatten(), reduction="none").view(
                targets.shape
            )
            for lg in logits
        ]
    )


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """[loops, ...] probability of exiting at each loop, as the serving exit rule reads the
    gate (hazard sigmoid(gate) after every loop; the last loop takes the rest)."""
    hazard = torch.sigmoid(gate_logits.float())
    remaining = torch.cumprod(1 - hazard, dim=0)
    before = torch.cat((torch.ones_like(remaining[:1]), remaining[:-1]))
    exits = before * hazard
    return torch.cat((exits[:-1], before[-1:]))


def stage1_loss(loss: torch.Tensor, gate_logits: torch.Tensor, beta: float) -> torch.Tensor:
    p = exit_distribution(gate_logits)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(0)
    return ((p * loss).sum(0) - beta * entropy).mean()


def stage2_loss(
    loss: torch.Tensor, gate_logits: torch.Tensor, k: float = 50.0, gamma: float = 0.005
) -> torch.Tensor:
    loss = loss.detach()
    improvement = loss[:-1] - loss[1:]
    stop = 1 - torch.sigmoid(k * (improvement - gamma))
    return F.binary_cross_entropy_with_logits(gate_logits[:-1].float(), stop)
