"""Token sampling that depends only on a request's own logits, params and token index.

Each draw uses a generator seeded from (seed, output_index), so a request's tokens never
depend on what else shares its batch, and a replay reproduces them exactly.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 63) - 1


class SamplingError(ValueError):
    """One row's draw cannot be computed (its logits or probabilities are not finite): that
    request fails, the other rows of its batch do not."""


def draw_seed(seed: int, output_index: int) -> int:
    # splitmix64-style mixing keeps neighbouring indices' streams unrelated.
    z = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


def sample_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    output_index: int,
) -> int:
    """Samples one token from float32 ``logits`` [V]; temperature 0 is greedy (argmax).
    Raises ``SamplingError`` when the row cannot be sampled (NaN logits, or an overflow)."""
    logits = logits.to(torch.float32)
    if temperature == 0.0:
        if bool(torch.isnan(logits).any()):
            raise SamplingError("the model produced NaN logits")
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cumulative - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()):
        raise SamplingError(
            f"sampling probabilities are not finite (temperature {temperature}, top_p {top_p})"
        )
    generator = torch.Generator().manual_seed(draw_seed(seed, output_index))
    return int(torch.multinomial(probs, 1, generator=generator))
