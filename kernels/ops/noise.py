"""The sampler's counter-based noise: a 32-bit hash of (seed, output_index, vocab id), its
uniforms and their Gumbel noise, written with int64 torch ops (the Triton sampler computes
the same integers in uint32). A pure function of those three integers: a change here changes
every seeded request's tokens.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# lowbias32's multipliers (Wellons' hash-prospector), the second one minus 2**32: both then
# fit in 31 bits, so a 32-bit value times either stays inside int64 and the low 32 bits are
# the uint32 product without relying on signed overflow.
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B - (1 << 32)
# domain separation: the row key and the vocab id are hashed from different starting points
ROW_SALT = 0x243F6A88
VOCAB_SALT = 0x85A308D3


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def _row_key(seed: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row. Each 32-bit half is absorbed then mixed, so for one seed the
    key is a bijection of the index: a request's draws never reuse noise."""
    key = _mix32((seed & MASK32) ^ ROW_SALT)
    key = _mix32(key ^ ((seed >> 32) & MASK32))
    key = _mix32(key ^ (output_index & MASK32))
    return _mix32(key ^ ((output_index >> 32) & MASK32))


def counter_hash(seed: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32-bit hashes, int64 [N, vocab_size], of (seed[i], output_index[i], vocab id j).

    Vocab ids are pre-mixed on their own so two rows whose keys differ in a few low bits do
    not get permutations of one another's noise."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    vocab = _mix32(ids ^ VOCAB_SALT)
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


# top-p sums masses as fixed point (1.0 == 2**40): integer prefix sums are exact, so the kept
# set does not depend on the scan kernel's order (CUDA scans one row with another kernel than
# many). A vocabulary of up to 2**23 ids keeps the total inside int64.
FIXED_ONE = float(1 << 40)
