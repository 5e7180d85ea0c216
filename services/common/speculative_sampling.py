"""The rejection rule of speculative sampling, with counter-based randomness.

A draft token ``x`` drawn from the draft distribution q is accepted with probability
``min(1, p(x) / q(x))``; otherwise the token is drawn from ``max(0, p - q)`` normalised.
The token then follows the target distribution p exactly. Both distributions are the
sampler's own: the logits over the temperature, with top-k and top-p applied
(``kernels/ops/sample.py``'s ``filter_threshold``). The uniform and the residual draw use
counter streams of their own, pure functions of (seed, output index), so a request's
tokens never depend on its neighbours (docs/speculative.md, "Sampling").
"""

from __future__ import annotations

import torch

from kernels.ops.noise import counter_hash, gumbel_noise, uniform_from_bits
from kernels.ops.sample import filter_threshold

# seed offsets of the two extra streams (the draw itself uses the plain seed): any fixed
# odd constants, distinct from each other
ACCEPT_STREAM = 0x5BD1E995
RESIDUAL_STREAM = 0x27D4EB2F
_MASK63 = (1 << 63) - 1


def _stream_seed(seed: int, stream: int) -> torch.Tensor:
    return torch.tensor([(seed ^ stream) & _MASK63], dtype=torch.int64)


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """float64 [V]: the distribution the sampler draws from for ``logits`` [V]."""
    vocab = logits.shape[-1]
    scaled = logits.reshape(1, vocab).to(torch.float32).cpu() / temperature
    threshold = filter_threshold(
        scaled, torch.tensor([top_k], dtype=torch.int64), torch.tensor([top_p], dtype=torch.float32)
    )
    kept = scaled >= threshold
    scores = torch.where(kept, scaled, float("-inf")).to(torch.float64)[0]
    return torch.softmax(scores, dim=-1)


def accept_or_resample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_token: int,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    output_index: int,
) -> int:
    """The token at ``output_index``: ``draft_token`` (drawn from the draft logits' q) if the
    rule accepts it, else a draw from the residual of the target's p over q."""
    p = filtered_probs(target_logits, temperature, top_k, top_p)
    q = filtered_probs(draft_logits, temperature, top_k, top_p)
    at = torch.tensor([output_index], dtype=torch.int64)
    u = float(uniform_from_bits(counter_hash(_stream_seed(seed, ACCEPT_STREAM), at, 1))[0, 0])
    px, qx = float(p[draft_token]), float(q[draft_token])
    if qx > 0.0 and u * qx < px:
        return draft_token
    residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: the draft is a draw from p
        return draft_token
    vocab = residual.shape[0]
    noise = gumbel_noise(_stream_seed(seed, RESIDUAL_STREAM), at, vocab)[0].to(torch.float64)
    scores = torch.where(residual > 0, torch.log(residual) + noise, float("-inf"))
    return int(torch.argmax(scores))
