"""Triton silu(gate) * up: a 2-D grid of (row, column tile), gate and up read side by side.

Imported only when a Triton path runs (see ``kernels.ops._triton``). The reference's rounding
steps are kept: silu rounds to the input dtype before the multiply by up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops._triton import next_power_of_2

_MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(in_ptr, out_ptr, in_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0)
    up = tl.load(in_ptr + row * in_stride + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even, got {width}")
    n_cols = width // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], n_cols))
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0 or n_cols == 0:
        return out
    out2 = out.view(-1, n_cols)
    block = min(_MAX_BLOCK, next_power_of_2(n_cols))
    grid = (rows.shape[0], triton.cdiv(n_cols, block))
    _silu_mul_kernel[grid](rows, out2, rows.stride(0), out2.stride(0), n_cols, BLOCK=block)
    return out
