"""Optional flash-attn detection; the torch reference kernels are always available."""

from __future__ import annotations

import functools

import torch


@functools.cache
def flash_attn_available() -> bool:
    """True only when CUDA is usable and ``flash_attn`` imports cleanly. Never raises."""
    try:
        if not torch.cuda.is_available():
            return False
        import flash_attn  # noqa: F401
    except Exception:
        # Broken wheels raise more than ImportError (missing CUDA libs, ABI mismatch, ...).
        return False
    return True
