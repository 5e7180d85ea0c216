"""Triton kernel of ``rlt::sample``: one program per row, no sort.

The reference sorts a row to find two thresholds: the k-th largest scaled logit (top-k) and
the value of the last token top-p keeps. Both are order statistics, found here by bisection
on the values' order-preserving uint32 keys (32 steps, each a pass over the row):

* k-th largest: the largest key t with count(key >= t) >= k;
* top-p's last kept value: the smallest element value v whose mass above it,
  G(v) = sum of the masses of the tokens strictly above v, is below top-p's bound. That is
  the sorted token at position ``kept - 1`` of the reference, ties included, because the
  masses ahead of a sorted position only grow.

Masses are the reference's fixed point integers, so the sums are exact in any order. Every
float is computed with the reference's operations: correctly rounded division and libdevice
``exp``/``log`` (what torch's CUDA kernels call, linked without flush-to-zero as nvcc builds
torch), never Triton's fast approximations. Greedy
rows only take the first argmax of the raw logits; a sampled row does the top-k passes only
with top-k on and the top-p passes only with top-p on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.ops.noise import FIXED_ONE, MASK32, MUL1, MUL2, ROW_SALT, VOCAB_SALT

# Vocabulary ids per tile of a pass over a row.
BLOCK = 2048

_MUL1_U32 = tl.constexpr(MUL1 & MASK32)
_MUL2_U32 = tl.constexpr(MUL2 & MASK32)
_ROW_SALT = tl.constexpr(ROW_SALT)
_VOCAB_SALT = tl.constexpr(VOCAB_SALT)
_FIXED_ONE = tl.constexpr(FIXED_ONE)
_SIGN = tl.constexpr(0x80000000)


@triton.jit
def _u32(value):
    return tl.cast(value, tl.uint32)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping products are the reference's masked int64 ones)."""
    x = x ^ (x >> 16)
    x = x * _u32(_MUL1_U32)
    x = x ^ (x >> 15)
    x = x * _u32(_MUL2_U32)
    return x ^ (x >> 16)


@triton.jit
def _key(x):
    """Order-preserving uint32 key of float32 values; -0.0 counts as +0.0, as a float
    comparison does."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | _u32(_SIGN))


@triton.jit
def _value(key):
    bits = tl.where(key >= _u32(_SIGN), key ^ _u32(_SIGN), ~key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    # libdevice's expf/logf are what torch's CUDA kernels call; tl.exp/tl.log compile to
    # approximations. The interpreter has no libdevice: numpy's there.
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _mass(x2, top, LIBDEVICE: tl.constexpr):
    """The reference's fixed point mass of a (top-k filtered) scaled value."""
    return (_exp(x2 - top, LIBDEVICE) * _FIXED_ONE).to(tl.int64)


@triton.jit
def _sample_kernel(
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seed_ptr,
    index_ptr,
    ids_ptr,
    bad_ptr,
    threshold_ptr,
    vocab,
    logits_s0,
    BLOCK_V: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * logits_s0
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0
    divisor = tl.where(greedy, 1.0, temperature).to(tl.float32)

    # pass 1: NaN anywhere, the raw argmax (greedy), the largest scaled value (sampled)
    nans = 0
    raw_best = tl.max(tl.full([BLOCK_V], neg_inf, tl.float32), axis=0)
    raw_at = 0
    top = raw_best
    for start in range(0, vocab, BLOCK_V):
        c = start + offs
        ok = c < vocab
        x = tl.load(base + c, mask=ok, other=neg_inf).to(tl.float32)
        nans += tl.sum((x != x).to(tl.int32), axis=0)
        tile_best = tl.max(x, axis=0)
        tile_at = tl.argmax(x, axis=0, tie_break_left=True)
        better = tile_best > raw_best
        raw_at = tl.where(better, start + tile_at, raw_at)
        raw_best = tl.where(better, tile_best, raw_best)
        scaled = tl.where(ok, tl.math.div_rn(x, divisor), neg_inf)
        top = tl.maximum(top, tl.max(scaled, axis=0))

    threshold = neg_inf
    token = raw_at
    bad = nans > 0
    if not greedy:
        top_k = tl.load(top_k_ptr + row).to(tl.int64)
        top_p = tl.load(top_p_ptr + row)
        kth = neg_inf
        if (top_k > 0) & (top_k < vocab):
            # the k-th largest key: bit by bit, the largest t with count(key >= t) >= k
            found = _u32(0)
            for i in range(32):
                candidate = found | (_u32(1) << (31 - i))
                count = 0
                for start in range(0, vocab, BLOCK_V):
                    c = start + offs
                    ok = c < vocab
                    x = tl.load(base + c, mask=ok, other=neg_inf).to(tl.float32)
                    keys = _key(tl.math.div_rn(x, divisor))
                    count += tl.sum(((keys >= candidate) & ok).to(tl.int32), axis=0)
                found = tl.where(count >= top_k, candidate, found)
            kth = _value(found)
        last_kept = neg_inf
        if top_p < 1.0:
            total = tl.sum(tl.zeros([BLOCK_V], tl.int64), axis=0)
            smallest = float("inf")
            for start in range(0, vocab, BLOCK_V):
                c = start + offs
                ok = c < vocab
                x = tl.load(base + c, mask=ok, other=neg_inf).to(tl.float32)
                scaled = tl.math.div_rn(x, divisor)
                x2 = tl.where(scaled >= kth, scaled, neg_inf)
                total += tl.sum(tl.where(ok, _mass(x2, top, LIBDEVICE), 0), axis=0)
                smallest = tl.minimum(smallest, tl.min(tl.where(ok, x2, float("inf")), axis=0))
            bound = tl.math.ceil(top_p.to(tl.float64) * total.to(tl.float64)).to(tl.int64)
            if bound <= 0:
                last_kept = float("inf")  # keeps nothing: the row is bad
            elif total < bound:
                last_kept = smallest  # the bound's rounding passed the total: all kept
            else:
                # the largest t with G(t) >= bound; t + 1 is the key of the last kept value
                above = _u32(0)
                for i in range(32):
                    candidate = above | (_u32(1) << (31 - i))
                    mass = tl.sum(tl.zeros([BLOCK_V], tl.int64), axis=0)
                    for start in range(0, vocab, BLOCK_V):
                        c = start + offs
                        ok = c < vocab
                        x = tl.load(base + c, mask=ok, other=neg_inf).to(tl.float32)
                        scaled = tl.math.div_rn(x, divisor)
                        x2 = tl.where(scaled >= kth, scaled, neg_inf)
                        counted = ok & (_key(x2) > candidate)
                        mass += tl.sum(tl.where(counted, _mass(x2, top, LIBDEVICE), 0), axis=0)
                    above = tl.where(mass >= bound, candidate, above)
                last_kept = _value(above + _u32(1))
        threshold = tl.maximum(kth, last_kept)

        # the draw: argmax of the kept scaled logits plus the row's Gumbel noise
        seed = tl.load(seed_ptr + row)
        index = tl.load(index_ptr + row)
        key = _mix32(seed.to(tl.uint32) ^ _u32(_ROW_SALT))
        key = _mix32(key ^ (seed >> 32).to(tl.uint32))
        key = _mix32(key ^ index.to(tl.uint32))
        key = _mix32(key ^ (index >> 32).to(tl.uint32))
        best = neg_inf
        kept_top = neg_inf
        token = 0
        for start in range(0, vocab, BLOCK_V):
            c = start + offs
            ok = c < vocab
            x = tl.load(base + c, mask=ok, other=neg_inf).to(tl.float32)
            scaled = tl.math.div_rn(x, divisor)
            kept = tl.where(ok & (scaled >= threshold), scaled, neg_inf)
            bits = _mix32(_mix32(c.to(tl.uint32) ^ _u32(_VOCAB_SALT)) ^ key)
            u = (((bits >> 9) << 1) | _u32(1)).to(tl.float32) * (2.0**-24)
            drawn = kept + -_log(-_log(u, LIBDEVICE), LIBDEVICE)
            tile_best = tl.max(drawn, axis=0)
            tile_at = tl.argmax(drawn, axis=0, tie_break_left=True)
            better = tile_best > best
            token = tl.where(better, start + tile_at, token)
            best = tl.where(better, tile_best, best)
            kept_top = tl.maximum(kept_top, tl.max(kept, axis=0))
        finite = (top > neg_inf) & (top < float("inf")) & (kept_top > neg_inf)
        finite = finite & (kept_top < float("inf"))
        bad = bad | (temperature != temperature) | (temperature < 0) | ~finite
    tl.store(ids_ptr + row, tl.where(bad, 0, token).to(tl.int64))
    tl.store(bad_ptr + row, bad.to(tl.int8))
    tl.store(threshold_ptr + row, threshold)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, bad, threshold per row): the threshold is what the filters keep (-inf: all;
    +inf: nothing), for tests."""
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    bad = torch.empty(rows, dtype=torch.bool, device=logits.device)
    threshold = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        _sample_kernel[(rows,)](
            logits,
            temperature.contiguous(),
            top_k.contiguous(),
            top_p.contiguous(),
            seed.contiguous(),
            output_index.contiguous(),
            ids,
            bad.view(torch.int8),
            threshold,
            vocab,
            logits.stride(0),
            BLOCK_V=min(BLOCK, triton.next_power_of_2(vocab)),
            LIBDEVICE=logits.device.type == "cuda",
            num_warps=8,
            # no fused multiply-adds: each float is the reference's rounding, step by step
            enable_fp_fusion=False,
            # libdevice's exp/log as nvcc builds torch's (subnormals kept, not flushed)
            enable_reflect_ftz=False,
        )
    return ids, bad, threshold
