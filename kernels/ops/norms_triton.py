"""Triton RMSNorm kernels: one program per row, the whole row in registers.

Imported only when a Triton path runs (see ``kernels.ops._triton``). Each rounding step of the
reference is kept (normalise in float32, cast to the input dtype, then the weight multiply), so
low-precision results match the torch reference to an ulp or so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops._triton import next_power_of_2


@triton.jit
def _normed(x, w, n_cols, eps):
    """rms_norm of one loaded row (padding lanes hold 0), in float32 before the final cast."""
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / n_cols
    y = (x32 * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    return w.to(tl.float32) * y.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _normed(x, w, n_cols, eps)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    a_ptr,
    w_out_ptr,
    w_next_ptr,
    h_new_ptr,
    x_ptr,
    h_stride,
    a_stride,
    h_new_stride,
    x_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0)
    a = tl.load(a_ptr + row * a_stride + cols, mask=mask, other=0.0)
    w_out = tl.load(w_out_ptr + cols, mask=mask, other=0.0)
    w_next = tl.load(w_next_ptr + cols, mask=mask, other=0.0)
    h_dtype = h_new_ptr.dtype.element_ty
    normed_a = _normed(a, w_out, n_cols, eps).to(h_dtype)
    h_new = (h.to(tl.float32) + normed_a.to(tl.float32)).to(h_dtype)
    tl.store(h_new_ptr + row * h_new_stride + cols, h_new, mask=mask)
    x = _normed(h_new, w_next, n_cols, eps)
    tl.store(x_ptr + row * x_stride + cols, x.to(x_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [N, H] with unit column stride (a view when possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n_cols = x.shape[-1]
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    x2 = _rows(x)
    if x2.shape[0] == 0:
        return out
    out2 = out.view(-1, n_cols)
    block = next_power_of_2(n_cols)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        weight.contiguous(),
        out2,
        x2.stride(0),
        out2.stride(0),
        n_cols,
        eps,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


def add_rms_norm(
    h: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if h.shape != a.shape:
        raise ValueError(f"h {tuple(h.shape)} and a {tuple(a.shape)} differ")
    n_cols = h.shape[-1]
    h_dtype = torch.promote_types(h.dtype, torch.promote_types(a.dtype, w_out.dtype))
    h_new = h.new_empty(h.shape, dtype=h_dtype)
    x = h.new_empty(h.shape, dtype=torch.promote_types(h_dtype, w_next.dtype))
    h2, a2 = _rows(h), _rows(a)
    if h2.shape[0] == 0:
        return h_new, x
    h_new2, x2 = h_new.view(-1, n_cols), x.view(-1, n_cols)
    block = next_power_of_2(n_cols)
    _add_rms_norm_kernel[(h2.shape[0],)](
        h2,
        a2,
        w_out.contiguous(),
        w_next.contiguous(),
        h_new2,
        x2,
        h2.stride(0),
        a2.stride(0),
        h_new2.stride(0),
        x2.stride(0),
        n_cols,
        eps,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return h_new, x
