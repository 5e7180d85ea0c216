"""Every copy between the host and the device goes through here, so it can be counted.

A pass sends its inputs in one non-blocking copy from pinned memory (``to_device``) and a
batch brings its results back in one copy (``to_host``), the only point where the host
waits for the device. What the host needs only in a later batch (token-sparse windows'
choices) comes back without a wait of its own (``readback``), read after that one. On a
CPU these are plain copies, counted the same way, so a CPU test holds the number of
synchronisations a GPU would pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TransferCounts:
    to_device: int = 0
    to_host: int = 0  # each one waits for the device: a synchronisation
    readback: int = 0  # copies to the host that do not wait (read after the next to_host)


class Transfer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts = TransferCounts()
        self._pinned = device.type == "cuda"
        # pinned host words, one buffer per pass since the last wait: an asynchronous copy
        # may still be reading a buffer until ``to_host`` has waited for the device
        self._staging: list[torch.Tensor] = []
        self._in_use = 0

    def host_words(self, size: int) -> np.ndarray:
        """A host int32 buffer of ``size`` words to fill before ``to_device`` (pinned on
        CUDA, so the copy can be asynchronous); not handed out again before ``to_host``."""
        if self._in_use == len(self._staging):
            self._staging.append(torch.empty(0, dtype=torch.int32))
        buffer = self._staging[self._in_use]
        if buffer.numel() < size:
            buffer = torch.empty(
                max(size, 2 * buffer.numel()), dtype=torch.int32, pin_memory=self._pinned
            )
            self._staging[self._in_use] = buffer
        self._in_use += 1
        return buffer.numpy()[:size]

    def to_device(self, words: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``words`` (a prefix of ``host_words``) on the device, into ``out`` if given."""
        self.counts.to_device += 1
        host = torch.from_numpy(words)
        if out is not None:
            out[: host.numel()].copy_(host, non_blocking=True)
            return out[: host.numel()]
        if self.device.type == "cpu":
            return host  # not reused before ``to_host``
        return host.to(self.device, non_blocking=True)

    def readback(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``tensor`` copied to host memory without waiting, and the number of waits so far:
        its values may be read once ``to_host`` has waited more often than that."""
        self.counts.readback += 1
        if self.device.type == "cpu":
            return tensor, self.counts.to_host
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host, self.counts.to_host

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the host; waits for the device to finish everything before it."""
        self.counts.to_host += 1
        host = tensor.to("cpu")
        self._in_use = 0  # every copy before this one has completed
        return host
