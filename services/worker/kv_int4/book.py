"""What the host knows of each request's int4-delta blocks: the plane each of its tokens is
stored up to (``top``: a token that exited early stores no delta above its exit loop), how
far each plane is final, and how many of each plane's leading blocks are sealed.

A block is sealed at plane j once every token of it is final at plane j: written by the
token's own loop j, or copied there when it exited below j. Positions become final in
order in every plane (a chunk's loop j runs after the chunks before it ran loop j), so a
plane's final tokens are a prefix.

Under self-speculation (docs/speculative.md) a cycle writes positions whose input is a draft:
their K/V is final only once they are committed, and a rejected draft's positions are
written again by the next cycle. ``committed`` (while such positions exist) is where the
committed prefix ends: sealing after a batch stops there, and a block holding positions
that may be written again keeps every tail it has (``uncertain``), so that when it is
written again its committed tokens are still exact in the tail.
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
    # speculation: positions below ``committed`` are final at every plane; those in
    # ``committed .. drafted_to`` were written by a cycle and may be written again (None:
    # no such positions)
    committed: int | None = None
    drafted_to: int = 0
    cycle_open: bool = False
    # tails kept for uncertain blocks: (block index, block id to close, the block id whose
    # seal gave it back)
    held: list[tuple[int, int, int]] = field(default_factory=list)
    # token-sparse prefill: the first loop that freezes prompt tokens (None: never), and
    # the prompt's length
    freezes_from: int | None = None
    prompt_len: int = 0
    window: int = 0  # its windows' length (they start at multiples of it)

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
        if self.committed == position and not self.cycle_open:  # a plain row after a cycle
            self._advance(position + 1)

    # ------------------------------------------------------------------ speculation
    def speculating(self, committed: int, drafted_to: int) -> None:
        """A cycle is open: positions from ``committed`` up to ``drafted_to`` may be drafts."""
        self.committed = committed
        self.drafted_to = max(self.drafted_to, drafted_to)
        self.cycle_open = True

    def cycle_ended(self, committed: int) -> None:
        """The cycle ended with ``committed`` positions committed: what it wrote after them
        is not final at any plane (it is written again, from other inputs)."""
        self.cycle_open = False
        self.final = [min(f, committed) for f in self.final]
        self.tops = {p: t for p, t in self.tops.items() if p < committed}
        self._advance(committed)

    def _advance(self, committed: int) -> None:
        self.committed = None if committed >= self.drafted_to else committed

    def seal_limit(self, plane: int) -> int:
        """Positions final at ``plane`` that may be sealed after a batch."""
        if self.committed is None:
            return self.final[plane]
        return min(self.final[plane], self.committed)

    def uncertain(self, block: int, block_size: int) -> bool:
        """Whether ``block`` holds a position that may be written again."""
        if self.committed is None:
            return False
        start, end = block * block_size, (block + 1) * block_size
        return end > self.committed and (self.cycle_open or start < self.drafted_to)

    def may_copy_up(self, plane: int, block: int, block_size: int) -> bool:
        """Whether token-sparse prefill may copy a frozen token of ``block`` from ``plane``
        up into the plane above (its tail there must stay until that plane is sealed)."""
        if self.freezes_from is None:
            return False
        return plane + 1 >= self.freezes_from and block * block_size < self.prompt_len

    def window_of(self, position: int) -> tuple[int, int]:
        """[start, end) of the token-sparse window holding ``position``."""
        start = position - position % self.window
        return start, min(start + self.window, self.prompt_len)

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
