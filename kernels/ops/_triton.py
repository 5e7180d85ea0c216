"""Whether the Triton kernels can run here.

The op modules never import triton at module level: it may be absent (CPU images), and it costs
~0.2 s to import. Its kernel modules (``*_triton.py``) are imported on the first Triton call.
"""

from __future__ import annotations

import functools


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
