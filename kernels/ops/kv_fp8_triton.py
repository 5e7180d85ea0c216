"""Triton side of the fp8 codec: e4m3 encode/decode helpers (the attention kernels use
``e4m3_decode`` as they load a tile) and the quantize/dequantize kernels.

The helpers build the bits by integer arithmetic and bitcasts only, so they behave the same
on every Triton version and under the interpreter (no fp8 dtype needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_codec import FP8_MAX
from kernels.ops._triton import next_power_of_2

# Adding and subtracting 2**23 rounds a float32 in [0, 2**22) to an integer, ties to even.
_ROUND = 8388608.0


@triton.jit
def e4m3_decode(codes):
    """uint8 e4m3 codes -> float32 values (code 0x7f/0xff, NaN, is never written)."""
    c = codes.to(tl.int32)
    exponent = (c >> 3) & 15
    mantissa = c & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    magnitude = tl.where(
        exponent == 0,
        mantissa.to(tl.float32) * 0.001953125,  # subnormal: m * 2**-9
        normal.to(tl.float32, bitcast=True),
    )
    return tl.where((c & 128) != 0, -magnitude, magnitude)


@triton.jit
def e4m3_encode(y):
    """float32 values in [-448, 448] -> uint8 e4m3 codes, rounded to nearest even (the sign
    of -0.0 and of negatives that round to 0 kept, as torch's conversion does)."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    # the binade's step: 2**(e - 3) for a in [2**e, 2**(e + 1)); 2**-9 below 2**-6
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)
    q = ((a * inv_step + _ROUND) - _ROUND) * step
    qbits = q.to(tl.int32, bitcast=True)
    qe = ((qbits >> 23) & 255) - 127
    code = tl.where(
        qe >= -6,
        ((qe + 7) << 3) | ((qbits >> 20) & 7),
        (q * 512.0).to(tl.int32),
    )
    sign = (bits >> 31) & 1
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    x = tl.load(x_ptr + row * HEAD_DIM + d, mask=ok, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) / FP8_MAX
    y = x / tl.where(scale > 0, scale, 1.0)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    tl.store(codes_ptr + row * HEAD_DIM + d, e4m3_encode(y), mask=ok)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _dequantize_kernel(
    codes_ptr, scale_ptr, out_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    codes = tl.load(codes_ptr + row * HEAD_DIM + d, mask=ok, other=0)
    value = e4m3_decode(codes) * tl.load(scale_ptr + row)
    tl.store(out_ptr + row * HEAD_DIM + d, value.to(out_ptr.dtype.element_ty), mask=ok)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    head_dim = x.shape[-1]
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rows = scale.numel()
    if rows:
        _quantize_kernel[(rows,)](
            x, codes, scale, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim)
        )
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes, scale = codes.contiguous(), scale.contiguous()
    head_dim = codes.shape[-1]
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    rows = scale.numel()
    if rows:
        _dequantize_kernel[(rows,)](
            codes, scale, out, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim)
        )
    return out


@triton.jit
def fp8_rows(ptrs, mask, scale_ptrs, row_ok):
    """A [N, D] tile of e4m3 codes -> float32 values, one scale per row (position)."""
    codes = tl.load(ptrs, mask=mask, other=0)
    scales = tl.load(scale_ptrs, mask=row_ok, other=0.0)
    return e4m3_decode(codes) * scales[:, None]


@triton.jit
def fp8_cols(ptrs, mask, scale_ptrs, col_ok):
    """A [D, N] (transposed) tile of e4m3 codes -> float32 values, one scale per column."""
    codes = tl.load(ptrs, mask=mask, other=0)
    scales = tl.load(scale_ptrs, mask=col_ok, other=0.0)
    return e4m3_decode(codes) * scales[None, :]
