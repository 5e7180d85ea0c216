"""``rlt::fp8_quantize`` / ``rlt::fp8_dequantize``: the fp8 KV codec of ``kernels.kv_codec``.

One scale per (token, kv head): ``scale = amax / 448`` over the head's channels (float32), the
codes e4m3 (e4m3fn: bias 7, no infinities, 448 the largest) of ``x / scale`` clamped to
+-448 and rounded to nearest even, stored as uint8. A head of zeros has scale 0 and codes 0.
Dequantising is ``e4m3(code) * scale``; the attention kernels do it as they load a tile
(``rlt::paged_attention`` with ``k_scale`` / ``v_scale``).
"""

from __future__ import annotations

import torch

from kernels.kv_codec import FP8_MAX
from kernels.ops._triton import triton_available

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define("fp8_quantize(Tensor x) -> (Tensor, Tensor)")
_lib.define("fp8_dequantize(Tensor codes, Tensor scale, ScalarType dtype) -> Tensor")


def fp8_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] -> (codes uint8 [..., hd], scale float32 [...])."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / FP8_MAX
    y = x32 / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def fp8_decode_reference(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) -> their float32 values."""
    return codes.view(torch.float8_e4m3fn).float()


def fp8_dequantize_reference(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (fp8_decode_reference(codes) * scale.unsqueeze(-1)).to(dtype)


def fp8_quantize_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.ops import kv_fp8_triton

    return kv_fp8_triton.quantize(x)


def fp8_dequantize_triton(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    from kernels.ops import kv_fp8_triton

    return kv_fp8_triton.dequantize(codes, scale, dtype)


def _quantize_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (fp8_quantize_triton if triton_available() else fp8_quantize_reference)(x)


def _dequantize_cuda(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if triton_available():
        return fp8_dequantize_triton(codes, scale, dtype)
    return fp8_dequantize_reference(codes, scale, dtype)


def _quantize_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _dequantize_fake(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.new_empty(codes.shape, dtype=dtype)


_lib.impl("fp8_quantize", fp8_quantize_reference, "CPU")
_lib.impl("fp8_quantize", _quantize_cuda, "CUDA")
_lib.impl("fp8_dequantize", fp8_dequantize_reference, "CPU")
_lib.impl("fp8_dequantize", _dequantize_cuda, "CUDA")
torch.library.register_fake("rlt::fp8_quantize", _quantize_fake, lib=_lib)
torch.library.register_fake("rlt::fp8_dequantize", _dequantize_fake, lib=_lib)

_quantize_op = torch.ops.rlt.fp8_quantize.default
_dequantize_op = torch.ops.rlt.fp8_dequantize.default


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] (any float dtype) -> (e4m3 codes uint8 [..., hd], float32 scales [...])."""
    return _quantize_op(x)


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``codes`` and ``scale`` stand for, in ``dtype``."""
    return _dequantize_op(codes, scale, dtype)
