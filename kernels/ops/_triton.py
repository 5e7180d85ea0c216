"""Whether the Triton kernels can run here, and the grid arithmetic their wrappers share.

The op modules never import triton at module level: it may be absent (CPU images), and it costs
~0.2 s to import. Its kernel modules (``*_triton.py``) are imported on the first Triton call.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    """True when triton imports cleanly. Never raises."""
    try:
        import triton.language  # noqa: F401
    except Exception:
        # A broken install raises more than ImportError (missing libs, version skew).
        return False
    return True


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton tile sizes must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()


# Most splits of one (segment, head)'s context in a decode grid: more only add partials.
MAX_SPLITS = 32
# Programs a decode grid aims for per streaming multiprocessor (a few keep HBM busy).
PROGRAMS_PER_SM = 4


def decode_splits(num_segs: int, num_heads: int, num_sms: int) -> int:
    """Splits of each (segment, head)'s context in a decode grid: enough programs to give
    every SM a few (``PROGRAMS_PER_SM``), at most ``MAX_SPLITS``. It depends only on the grid's
    shape, so a static decode bucket always runs the same split count (graph-safe)."""
    programs = max(num_segs * num_heads, 1)
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * num_sms // programs)))


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H100's 132 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
