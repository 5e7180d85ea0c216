"""One core pass's inputs as flat integer arrays: built on the host with numpy (no per-row
tensors), sent to the device in one copy, and read there through views (no kernel).

Everything is int32; float32 fields travel as their bits and 64-bit fields as two int32
words, so one buffer carries the whole pass. Sections (sizes in ``PassShape``):

- per token row (T): position, KV slot (-1: padding, not written), token id and whether the
  row is embedded from it, and the decode hidden-state slot it reads and writes;
- per segment (S, one per row of the batch): its block table, context length, first row;
- per decode row (N): its row, loops after this one, the exit rule's parameters, and
  survival so far;
- per exit-copy pair (M): LAST_EXITED source and destination slots and the decode row whose
  exit makes the copy;
- per coda row (C): its row and the sampling parameters (seed and token index as int64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

# fields per section, in order; "*" marks float32 fields, "**" int64 fields (two words)
_TOKEN_FIELDS = ("position", "slot", "token_id", "embed", "pool_slot")
_DECODE_FIELDS = (
    "row",
    "loops_run",
    "min_loops",
    "max_loops",
    "forced",
    "threshold*",
    "remaining*",
)
_PAIR_FIELDS = ("src", "dst", "decode_row")
_CODA_FIELDS = ("row", "top_k", "temperature*", "top_p*", "seed**", "output_index**")


@dataclass(frozen=True)
class PassShape:
    num_tokens: int  # T
    num_segments: int  # S
    table_width: int  # block table entries per segment
    num_decode: int  # N
    num_pairs: int  # M
    num_coda: int  # C

    def offsets(self) -> dict[str, tuple[int, int]]:
        """(start, length) in int32 words of every field; int64 fields start 8-byte aligned."""
        return _offsets(self)

    @property
    def size(self) -> int:
        return self.offsets()["_size"][1]


@functools.lru_cache(maxsize=256)
def _offsets(shape: PassShape) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    at = 0

    def put(name: str, length: int, align: int = 1) -> None:
        nonlocal at
        at += -at % align
        out[name] = (at, length)
        at += length

    for f in _TOKEN_FIELDS:
        put(f"token.{f}", shape.num_tokens)
    put("segment.table", shape.num_segments * shape.table_width)
    put("segment.context_len", shape.num_segments)
    put("segment.query_start", shape.num_segments + 1)
    for f in _DECODE_FIELDS:
        put(f"decode.{f.rstrip('*')}", shape.num_decode)
    for f in _PAIR_FIELDS:
        put(f"pair.{f}", shape.num_pairs)
    for f in _CODA_FIELDS:
        wide = f.endswith("**")
        put(
            f"coda.{f.rstrip('*')}",
            2 * shape.num_coda if wide else shape.num_coda,
            2 if wide else 1,
        )
    out["_size"] = (0, at + (-at % 2))
    return out


_FLOAT = {f"decode.{f.rstrip('*')}" for f in _DECODE_FIELDS if f.endswith("*")} | {
    f"coda.{f.rstrip('*')}" for f in _CODA_FIELDS if f.endswith("*") and not f.endswith("**")
}
_WIDE = {f"coda.{f.rstrip('*')}" for f in _CODA_FIELDS if f.endswith("**")}


class HostPass:
    """The host side: numpy views of one int32 buffer, filled field by field."""

    def __init__(self, shape: PassShape, buffer: np.ndarray | None = None) -> None:
        self.shape = shape
        self.offsets = shape.offsets()
        size = self.offsets["_size"][1]
        self.buffer = np.zeros(size, dtype=np.int32) if buffer is None else buffer[:size]
        if buffer is not None:
            self.buffer[:] = 0

    def __getitem__(self, name: str) -> np.ndarray:
        start, length = self.offsets[name]
        words = self.buffer[start : start + length]
        if name in _FLOAT:
            return words.view(np.float32)
        if name in _WIDE:
            return words.view(np.int64)
        if name == "segment.table":
            return words.reshape(self.shape.num_segments, self.shape.table_width)
        return words


class DevicePass:
    """The device side: tensor views of the copied buffer, one per field (no kernels), each
    made once per pass."""

    def __init__(self, shape: PassShape, words: torch.Tensor) -> None:
        self.shape = shape
        self.offsets = shape.offsets()
        self.words = words
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self._view(name)
        return view

    def _view(self, name: str) -> torch.Tensor:
        start, length = self.offsets[name]
        words = self.words[start : start + length]
        if name in _FLOAT:
            return words.view(torch.float32)
        if name in _WIDE:
            return words.view(torch.int64)
        if name == "segment.table":
            return words.view(self.shape.num_segments, self.shape.table_width)
        return words
