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


# Keys per tile of the fp8/auto decode kernel (``attention_decode_triton.py``), its default
# split alignment, and so the fewest keys a partition of int4-delta's split-K kernel reads.
DECODE_BLOCK_N = 64
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


def partition_blocks(block_size: int) -> int:
    """Blocks in one partition of a decode kernel that walks the context block by block
    (int4-delta's split-K kernel): at least ``DECODE_BLOCK_N`` keys, as a split of the
    fp8/auto decode kernel."""
    return -(-DECODE_BLOCK_N // max(block_size, 1))


def int4_decode_partitions(
    max_query_len: int,
    num_segs: int,
    num_heads: int,
    table_blocks: int,
    block_size: int,
    num_sms: int,
) -> int:
    """Partitions of each decode row's context for int4-delta's split-K kernel; 1 means the
    plain kernel (one program per row and head). Decode passes only (``max_query_len`` 1):
    ``decode_splits``' count for the grid, at most as many partitions of
    ``partition_blocks`` as the block table's width (``table_blocks``, which bounds every
    context) fills. Shapes only, never values: a captured decode bucket keeps its kernel."""
    if max_query_len != 1:
        return 1
    fills = -(-table_blocks // partition_blocks(block_size))
    return max(1, min(decode_splits(num_segs, num_heads, num_sms), fills))
