"""The hidden state of every request's token in progress, one row per request, on the device.

A decode row that goes on to another loop leaves its hidden state here and its next row
reads it back; a pass gathers and scatters whole rows by slot index, so it has fixed shapes
(a CUDA graph replays it) and no per-row tensor exists on the host. Row ``SCRATCH`` takes
the writes of padding rows.
"""

from __future__ import annotations

import torch


class DecodePool:
    SCRATCH = 0
    DEFAULT_CAPACITY = 256

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.rows = torch.zeros((capacity, hidden_size), dtype=dtype, device=device)
        self._free = list(range(capacity - 1, 0, -1))  # the scratch row is never handed out
        self.version = 0  # bumped when ``rows`` is reallocated (captured graphs go stale)

    def allocate(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot != self.SCRATCH:
            self._free.append(slot)

    def _grow(self) -> None:
        old = self.rows
        capacity = old.shape[0]
        self.rows = torch.zeros((2 * capacity, old.shape[1]), dtype=old.dtype, device=old.device)
        self.rows[:capacity] = old
        self._free = list(range(2 * capacity - 1, capacity - 1, -1))
        self.version += 1
