"""Token sampling that depends only on a request's own logits, params and token index.

``sample_batch`` samples every row of a batch where its logits are, with no host sync. It
uses the Gumbel-max trick: the token is ``argmax(filtered_scaled_logits + g)``, with Gumbel
noise ``g`` made from a counter-based hash of (seed, output_index, vocab id). The noise is a
pure function of those three integers, so a request's tokens never depend on what else shares
its batch, its row, the batch size or the device, and a replay reproduces them exactly.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# lowbias32's multipliers (Wellons' hash-prospector), the second one minus 2**32: both then
# fit in 31 bits, so a 32-bit value times either stays inside int64 and the low 32 bits are
# the uint32 product without relying on signed overflow.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
# domain separation: the row key and the vocab id are hashed from different starting points
_ROW_SALT = 0x243F6A88
_VOCAB_SALT = 0x85A308D3
# top-p sums masses as fixed point (1.0 == 2**40): integer prefix sums are exact, so the kept
# set does not depend on the scan kernel's order (CUDA scans one row with another kernel than
# many). A vocabulary of up to 2**23 ids keeps the total inside int64.
_FIXED_ONE = float(1 << 40)


class SamplingError(ValueError):
    """One row's draw cannot be computed (its logits or probabilities are not finite): that
    request fails, the other rows of its batch do not."""


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def _row_key(seed: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row. Each 32-bit half is absorbed then mixed, so for one seed the
    key is a bijection of the index: a request's draws never reuse noise."""
    key = _mix32((seed & _MASK32) ^ _ROW_SALT)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ (output_index & _MASK32))
    return _mix32(key ^ ((output_index >> 32) & _MASK32))


def counter_hash(seed: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32-bit hashes, int64 [N, vocab_size], of (seed[i], output_index[i], vocab id j).

    Vocab ids are pre-mixed on their own so two rows whose keys differ in a few low bits do
    not get permutations of one another's noise."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    vocab = _mix32(ids ^ _VOCAB_SALT)
    key = _row_key(seed.to(torch.int64), output_index.to(torch.int64))
    return _mix32(vocab[None, :] ^ key[:, None])


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in the open interval (0, 1) from 32-bit hashes: the top 23 bits as
    the odd numerator (2k + 1) / 2**24, exact in float32, so never 0 and never 1."""
    odd = ((bits >> 9) << 1) | 1
    return odd.to(torch.float32) * (2.0**-24)


def gumbel_noise(seed: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [N, vocab_size], for each row's (seed, output_index)."""
    u = uniform_from_bits(counter_hash(seed, output_index, vocab_size))
    return -torch.log(-torch.log(u))


def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` with the tokens top-k and then top-p drop set to -inf.

    Each filter becomes a per-row threshold on the value: top-k keeps every token equal to
    the k-th largest, and top-p keeps the smallest prefix of the sorted probabilities whose
    mass reaches top_p (a token is dropped when the mass before it is already >= top_p), plus
    any token tied with the last one kept. A top_p that is 0 in float32 keeps nothing: the
    caller reports that row as bad."""
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
    mass = (torch.exp(ordered - ordered[:, :1]) * _FIXED_ONE).to(torch.int64)
    through = torch.cumsum(mass, dim=-1)
    before = through - mass  # non-decreasing: the mass ahead of each sorted token
    # an integer is below top_p * total exactly when it is below that bound's ceiling
    bound = torch.ceil(top_p.to(torch.float64)[:, None] * through[:, -1:].to(torch.float64))
    kept = torch.searchsorted(before, bound.to(torch.int64))  # how many lie below it
    last_kept = ordered.gather(-1, (kept - 1).clamp(min=0))
    last_kept = torch.where(kept > 0, last_kept, float("inf"))  # nothing kept: the row is bad
    top_p_on = (top_p < 1.0)[:, None]
    threshold = torch.maximum(kth, torch.where(top_p_on, last_kept, neg_inf))
    return torch.where(scaled >= threshold, scaled, neg_inf)


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
    greedy = temperature == 0
    nan_rows = torch.isnan(logits).any(dim=-1)
    greedy_ids = torch.argmax(logits, dim=-1)

    # greedy rows divide by 1 so that their unused sampled branch is harmless
    divisor = torch.where(greedy, 1.0, temperature).to(torch.float32)
    scaled = logits.to(torch.float32) / divisor[:, None]
    filtered = _filter(scaled, top_k, top_p) if filters else scaled
    noise = gumbel_noise(seed, output_index, logits.shape[-1])
    sampled_ids = torch.argmax(filtered + noise, dim=-1)

    # amax propagates NaN; +inf is an overflow, -inf leaves nothing to draw
    unsampleable = ~(temperature > 0) | ~torch.isfinite(scaled.amax(dim=-1))
    if filters:  # they turn NaN into -inf, and may keep nothing
        unsampleable |= ~torch.isfinite(filtered.amax(dim=-1))
    bad = nan_rows | (~greedy & unsampleable)
    ids = torch.where(greedy, greedy_ids, sampled_ids)
    return torch.where(bad, 0, ids), bad


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
    kept = torch.isfinite(
        _filter(
            scaled,
            torch.tensor([top_k], dtype=torch.int64, device=logits.device),
            torch.tensor([top_p], dtype=torch.float32, device=logits.device),
        )
    )[0]
    at = torch.tensor([output_index], dtype=torch.int64, device=logits.device)
    noise = gumbel_noise(torch.tensor([seed], device=logits.device), at, vocab)[0]
    scores = logits.to(torch.float64) / temperature + noise.to(torch.float64)
    return torch.where(kept, scores, float("-inf"))
