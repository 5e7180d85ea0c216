"""Token sampling that depends only on a request's own logits, params and token index.

``sample_batch`` samples every row of a batch where its logits are, with no host sync, in
one ``rlt::sample`` op (``kernels/ops/sample.py``: a torch reference on CPU, a Triton kernel
on CUDA). It uses the Gumbel-max trick: the token is ``argmax(filtered_scaled_logits + g)``,
with Gumbel noise ``g`` made from a counter-based hash of (seed, output_index, vocab id). The
noise is a pure function of those three integers, so a request's tokens never depend on what
else shares its batch, its row, the batch size or the device, and a replay reproduces them
exactly.
"""

from __future__ import annotations

import torch

from kernels.ops.noise import counter_hash, gumbel_noise, uniform_from_bits
from kernels.ops.sample import filter_threshold, sample

__all__ = [
    "SamplingError",
    "counter_hash",
    "gumbel_noise",
    "sample_batch",
    "sample_token",
    "uniform_from_bits",
]


class SamplingError(ValueError):
    """One row's draw cannot be computed (its logits or probabilities are not finite): that
    request fails, the other rows of its batch do not."""


def sample_batch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    *,
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [N, V], on their device, without a host sync.

    Per row: ``temperature`` (0: greedy, the first argmax of the raw logits), ``top_k`` (0 or
    >= V: off), ``top_p`` (>= 1: off), ``seed`` and ``output_index`` (the noise's counter).
    ``temperature`` may be float32 or float64; greedy is ``temperature == 0`` in the dtype
    given, so pass float64 where a positive temperature could round to 0 in float32 (then the
    row is scaled by 0 and reported bad instead of silently going greedy). ``filters=False``
    skips top-k/top-p (and their sort) when the caller knows no row uses them; it gives the
    same tokens as ``filters=True`` then.

    Returns ``(ids, bad)``, int64 [N] and bool [N]. ``bad[i]`` says row i cannot be sampled:
    a NaN in its logits, or (sampled rows) a negative or NaN temperature, scaled logits whose
    maximum is not finite (the division overflowed, or nothing is finite), or filters that
    leave no finite token. ``ids[i]`` is 0 where ``bad[i]``.
    """
    return sample(logits, temperature, top_k, top_p, seed, output_index, filters=filters)


def sample_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    output_index: int,
) -> int:
    """Samples one token from ``logits`` [V] with ``sample_batch`` (one row, so the serial
    oracle and the batched engine draw the same tokens). Raises ``SamplingError`` when the row
    cannot be sampled (NaN logits, or an overflow)."""
    device = logits.device
    vocab = logits.shape[-1]
    ids, bad = sample_batch(
        logits.reshape(1, vocab),
        # float64 keeps a positive temperature below float32's range from turning greedy
        torch.tensor([temperature], dtype=torch.float64, device=device),
        torch.tensor([top_k], dtype=torch.int64, device=device),
        torch.tensor([top_p], dtype=torch.float32, device=device),
        torch.tensor([seed], dtype=torch.int64, device=device),
        torch.tensor([output_index], dtype=torch.int64, device=device),
        filters=0 < top_k < vocab or top_p < 1.0,
    )
    if bool(bad[0]):
        if bool(torch.isnan(logits).any()):
            raise SamplingError("the model produced NaN logits")
        raise SamplingError(
            f"sampling has no finite token to draw (temperature {temperature}, top_k {top_k}, "
            f"top_p {top_p})"
        )
    return int(ids[0])


def draw_scores(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    output_index: int,
) -> torch.Tensor:
    """float64 [V]: the scores a sampled draw of ``logits`` [V] takes the argmax of (the
    filtered logits over the temperature plus the Gumbel noise; -inf where the filters drop
    a token). The sum is formed in float64 so that the gap between two scores is not
    rounded again; the kept set is the float32 one ``sample_batch`` draws from."""
    vocab = logits.shape[-1]
    scaled = logits.reshape(1, vocab).to(torch.float32) / temperature
    threshold = filter_threshold(
        scaled,
        torch.tensor([top_k], dtype=torch.int64, device=logits.device),
        torch.tensor([top_p], dtype=torch.float32, device=logits.device),
    )
    kept = torch.isfinite(torch.where(scaled >= threshold, scaled, float("-inf")))[0]
    at = torch.tensor([output_index], dtype=torch.int64, device=logits.device)
    noise = gumbel_noise(torch.tensor([seed], device=logits.device), at, vocab)[0]
    scores = logits.to(torch.float64) / temperature + noise.to(torch.float64)
    return torch.where(kept, scores, float("-inf"))
