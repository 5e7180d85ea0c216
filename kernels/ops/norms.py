"""RMSNorm ops: ``rlt::rms_norm`` and Ouro's sandwich step ``rlt::add_rms_norm``.

The references are the model's math exactly (float32 CPU results stay bit-identical); on CUDA
a Triton kernel normalises each row in one pass when triton is importable.
"""

from __future__ import annotations

import torch

from kernels.ops._triton import triton_available

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define(
    "add_rms_norm(Tensor h, Tensor a, Tensor w_out, Tensor w_next, float eps) -> (Tensor, Tensor)"
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back before the weight multiply (as the HF reference does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    h: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h_new = h + rms_norm_reference(a, w_out, eps)
    return h_new, rms_norm_reference(h_new, w_next, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1)."""
    from kernels.ops import norms_triton

    return norms_triton.rms_norm(x, weight, eps)


def add_rms_norm_triton(
    h: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.ops import norms_triton

    return norms_triton.add_rms_norm(h, a, w_out, w_next, eps)


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if triton_available():
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def _add_rms_norm_cuda(
    h: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_available():
        return add_rms_norm_triton(h, a, w_out, w_next, eps)
    return add_rms_norm_reference(h, a, w_out, w_next, eps)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _add_rms_norm_fake(
    h: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h_dtype = torch.promote_types(h.dtype, torch.promote_types(a.dtype, w_out.dtype))
    x_dtype = torch.promote_types(h_dtype, w_next.dtype)
    return h.new_empty(h.shape, dtype=h_dtype), h.new_empty(h.shape, dtype=x_dtype)


_lib.impl("rms_norm", rms_norm_reference, "CPU")
_lib.impl("rms_norm", _rms_norm_cuda, "CUDA")
_lib.impl("add_rms_norm", add_rms_norm_reference, "CPU")
_lib.impl("add_rms_norm", _add_rms_norm_cuda, "CUDA")
torch.library.register_fake("rlt::rms_norm", _rms_norm_fake, lib=_lib)
torch.library.register_fake("rlt::add_rms_norm", _add_rms_norm_fake, lib=_lib)

_rms_norm_op = torch.ops.rlt.rms_norm.default
_add_rms_norm_op = torch.ops.rlt.add_rms_norm.default


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] with weight [H] -> [T, H] (one ``rlt::rms_norm`` call)."""
    return _rms_norm_op(x, weight, eps)


def add_rms_norm(
    h: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sandwich-norm step: ``h_new = h + rms_norm(a, w_out)``, ``x = rms_norm(h_new, w_next)``.

    Returns (h_new, x), both [T, H]; on CUDA one kernel reads each row once.
    """
    return _add_rms_norm_op(h, a, w_out, w_next, eps)
