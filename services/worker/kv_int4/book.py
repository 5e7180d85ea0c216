"""What the host knows of each request's int4-delta blocks: the plane each of its tokens is
stored up to (``top``: a token that exited early stores no delta above its exit loop), how
far each plane is final, and how many of each plane's leading blocks are sealed.

A block is sealed at plane j once every token of it is final at plane j: written by the
token's own loop j, or copied there when it exited below j. Positions become final in
order in every plane (a chunk's loop j runs after the chunks before it ran loop j), so a
plane's final tokens are a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestBook:
    planes: int
    final: list[int] = field(init=False)  # per plane: positions final there (a prefix)
    sealed_upto: list[int] = field(init=False)  # per plane: leading blocks known sealed
    tops: dict[int, int] = field(default_factory=dict)  # position -> top plane, if below

    def __post_init__(self) -> None:
        self.final = [0] * self.planes
        self.sealed_upto = [0] * self.planes

    def ran(self, first_plane: int, end_plane: int, end_position: int) -> None:
        """Positions up to ``end_position`` ran planes ``first_plane .. end_plane - 1``."""
        for j in range(first_plane, min(end_plane, self.planes)):
            self.final[j] = max(self.final[j], end_position)

    def exited(self, position: int, loops: int) -> None:
        """The token at ``position`` exited after ``loops`` loops: its K/V there was copied
        to every plane above, which stores no delta for it."""
        if loops < self.planes:
            self.tops[position] = loops - 1
            self.ran(loops, self.planes, position + 1)

    def stored(self, block: int, plane: int, block_size: int) -> np.ndarray:
        """The ``stored`` flags of one block at one plane."""
        flags = np.ones(block_size, dtype=np.uint8)
        if self.tops:
            start = block * block_size
            for offset in range(block_size):
                top = self.tops.get(start + offset)
                if top is not None and top < plane:
                    flags[offset] = 0
        return flags
