"""``rlt::sample``: one token per row of logits by the counter-based Gumbel-max draw.

The token is ``argmax(filtered_scaled_logits + g)``, with Gumbel noise ``g`` made from a
counter-based hash of (seed, output_index, vocab id): a pure function of those three integers,
so a request's tokens never depend on what else shares its batch, its row, the batch size or
the device. Greedy rows (temperature 0) take the first argmax of the raw logits.

The torch reference (the CPU kernel, and what ``services.common.sampling`` documents) sorts
each row for top-k/top-p; the Triton kernel (the CUDA kernel) finds the same two thresholds
without a sort, by bisection on the values' order-preserving integer keys, one program per
row, and skips the filter work of rows that do not filter and all of it for greedy rows.
Both compute every float with the same correctly rounded or library operations, so they give
the same token; the CUDA path is checked against the reference at start
(``kernels.ops.backends``) and falls back to it when they differ.
"""

from __future__ import annotations

import torch

from kernels.ops._triton import triton_available
from kernels.ops.noise import FIXED_ONE, gumbel_noise

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define(
    "sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
    "Tensor output_index, bool filters=True) -> (Tensor, Tensor)"
)


def filter_threshold(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per row, the value below which top-k and then top-p drop a token (-inf: none dropped).

    top-k keeps every token equal to the k-th largest, and top-p keeps the smallest prefix of
    the sorted probabilities whose mass reaches top_p (a token is dropped when the mass before
    it is already >= top_p), plus any token tied with the last one kept. A top_p that is 0 in
    float32 keeps nothing (+inf): the caller reports that row as bad."""
    vocab = scaled.shape[-1]
    ordered = torch.sort(scaled, dim=-1, descending=True).values
    # python scalars, not tensors: building a tensor would copy it to the device
    neg_inf = float("-inf")
    top_k = top_k.to(torch.int64)

    kth = ordered.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
    top_k_on = ((top_k > 0) & (top_k < vocab))[:, None]
    kth = torch.where(top_k_on, kth, neg_inf)
    ordered = torch.where(ordered >= kth, ordered, neg_inf)

    # masses relative to the largest (which is 1), truncated to fixed point
    mass = (torch.exp(ordered - ordered[:, :1]) * FIXED_ONE).to(torch.int64)
    through = torch.cumsum(mass, dim=-1)
    before = through - mass  # non-decreasing: the mass ahead of each sorted token
    # an integer is below top_p * total exactly when it is below that bound's ceiling
    bound = torch.ceil(top_p.to(torch.float64)[:, None] * through[:, -1:].to(torch.float64))
    kept = torch.searchsorted(before, bound.to(torch.int64))  # how many lie below it
    last_kept = ordered.gather(-1, (kept - 1).clamp(min=0))
    last_kept = torch.where(kept > 0, last_kept, float("inf"))  # nothing kept: the row is bad
    top_p_on = (top_p < 1.0)[:, None]
    return torch.maximum(kth, torch.where(top_p_on, last_kept, neg_inf))


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version: a sort per row when ``filters`` (some row may filter)."""
    greedy = temperature == 0
    nan_rows = torch.isnan(logits).any(dim=-1)
    greedy_ids = torch.argmax(logits, dim=-1)

    # greedy rows divide by 1 so that their unused sampled branch is harmless
    divisor = torch.where(greedy, 1.0, temperature).to(torch.float32)
    scaled = logits.to(torch.float32) / divisor[:, None]
    if filters:
        threshold = filter_threshold(scaled, top_k, top_p)
        filtered = torch.where(scaled >= threshold, scaled, float("-inf"))
    else:
        filtered = scaled
    noise = gumbel_noise(seed, output_index, logits.shape[-1])
    sampled_ids = torch.argmax(filtered + noise, dim=-1)

    # amax propagates NaN; +inf is an overflow, -inf leaves nothing to draw
    unsampleable = ~(temperature > 0) | ~torch.isfinite(scaled.amax(dim=-1))
    if filters:  # they turn NaN into -inf, and may keep nothing
        unsampleable |= ~torch.isfinite(filtered.amax(dim=-1))
    bad = nan_rows | (~greedy & unsampleable)
    ids = torch.where(greedy, greedy_ids, sampled_ids)
    return torch.where(bad, 0, ids), bad


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1);
    ``filters`` is not needed there (each row skips the filters it does not use)."""
    from kernels.ops import sample_triton as kernel

    ids, bad, _ = kernel.sample(logits, temperature, top_k, top_p, seed, output_index)
    return ids, bad


# Whether the CUDA op runs the Triton kernel: set at start by kernels.ops.backends once the
# kernel has drawn the reference's tokens on this device; the reference until then.
_cuda_kernel = {"triton": False}


def use_triton_on_cuda(enabled: bool) -> None:
    _cuda_kernel["triton"] = enabled and triton_available()


def _sample_cuda(*args: torch.Tensor | bool) -> tuple[torch.Tensor, torch.Tensor]:
    impl = sample_triton if _cuda_kernel["triton"] else sample_reference
    return impl(*args)  # type: ignore[arg-type]


def _sample_fake(logits: torch.Tensor, *rest: torch.Tensor | bool):
    n = logits.shape[0]
    return (
        logits.new_empty(n, dtype=torch.int64),
        logits.new_empty(n, dtype=torch.bool),
    )


_lib.impl("sample", sample_reference, "CPU")
_lib.impl("sample", _sample_cuda, "CUDA")
torch.library.register_fake("rlt::sample", _sample_fake, lib=_lib)
_sample_op = torch.ops.rlt.sample.default


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    *,
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [N, V] (one ``rlt::sample`` call, no host sync).

    Per row: ``temperature`` (float32 or float64; 0: greedy), ``top_k`` (int32 or int64; 0 or
    >= V: off), ``top_p`` (float32; >= 1: off), ``seed`` and ``output_index`` (int64, the
    noise's counter). ``filters=False`` promises that no row uses top-k or top-p (the reference
    then skips its sort). Returns ``(ids, bad)``, int64 [N] and bool [N]; ``ids`` is 0 where
    ``bad`` (see ``services.common.sampling.sample_batch``)."""
    return _sample_op(logits, temperature, top_k, top_p, seed, output_index, filters)
