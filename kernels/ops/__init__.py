"""Fused ops as ``torch.ops.rlt.*`` custom ops: plain torch on CPU, Triton on CUDA.

Importing this package registers the ops. Each op has a torch reference (the CPU kernel, and
the CUDA fallback when triton is missing) and a Triton kernel (the CUDA kernel); both are also
callable directly (``*_reference`` / ``*_triton`` in the op's module), the Triton ones on CPU
tensors under ``TRITON_INTERPRET=1``. The wrappers below are one op call each.
"""

from kernels.ops._triton import triton_available
from kernels.ops.activation import silu_mul
from kernels.ops.attention import paged_attention
from kernels.ops.exit_rule import exit_rule
from kernels.ops.kv_copy import copy_kv_slots_masked
from kernels.ops.norms import add_rms_norm, rms_norm
from kernels.ops.rope_kv import rope_write_kv
from kernels.ops.rope_kv_fp8 import rope_write_kv_fp8
from kernels.ops.sample import sample

__all__ = [
    "add_rms_norm",
    "copy_kv_slots_masked",
    "exit_rule",
    "paged_attention",
    "rms_norm",
    "rope_write_kv",
    "rope_write_kv_fp8",
    "sample",
    "silu_mul",
    "triton_available",
]
