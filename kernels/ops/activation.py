"""The SwiGLU activation op ``rlt::silu_mul``: silu(gate) * up over the fused gate_up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.ops._triton import triton_available

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define("silu_mul(Tensor gate_up) -> Tensor")


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on any device Triton drives (CPU tensors under TRITON_INTERPRET=1)."""
    from kernels.ops import activation_triton

    return activation_triton.silu_mul(gate_up)


def _silu_mul_cuda(gate_up: torch.Tensor) -> torch.Tensor:
    if triton_available():
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def _silu_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    torch._check(gate_up.shape[-1] % 2 == 0, lambda: "gate_up's last dim must be even")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


_lib.impl("silu_mul", silu_mul_reference, "CPU")
_lib.impl("silu_mul", _silu_mul_cuda, "CUDA")
torch.library.register_fake("rlt::silu_mul", _silu_mul_fake, lib=_lib)

_silu_mul_op = torch.ops.rlt.silu_mul.default


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I] (one ``rlt::silu_mul``)."""
    return _silu_mul_op(gate_up)
