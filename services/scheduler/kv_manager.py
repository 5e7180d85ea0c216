"""Logical depth-aware paged KV: block tables, free list, and the deltas the worker mirrors.

Every plane of a request grows in lockstep (a position gets a slot in all planes at once),
because a LAST_EXITED exit copy writes the token's slot in every higher plane.
"""

from __future__ import annotations

from collections import deque

from messages.batch import BlockDelta


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[list[int]]] = {}
        self._pending: dict[str, list[list[int]]] = {}

    # capacity -------------------------------------------------------------------------
    def blocks_per_plane(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks_per_plane(num_tokens) * self.num_planes

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_held_blocks(self, request_id: str) -> int:
        tables = self._tables.get(request_id)
        return sum(len(t) for t in tables) if tables else 0

    # allocation -----------------------------------------------------------------------
    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's tables to cover ``num_tokens`` positions; all or nothing."""
        tables = self._tables.get(request_id)
        have = len(tables[0]) if tables else 0
        want = self.blocks_per_plane(num_tokens)
        if want <= have:
            return True
        needed = (want - have) * self.num_planes
        if needed > len(self._free):
            return False
        if tables is None:
            tables = self._tables[request_id] = [[] for _ in range(self.num_planes)]
        pending = self._pending.setdefault(request_id, [[] for _ in range(self.num_planes)])
        for plane in range(self.num_planes):
            new = [self._free.popleft() for _ in range(want - have)]
            tables[plane].extend(new)
            pending[plane].extend(new)
        return True

    def free(self, request_id: str) -> None:
        tables = self._tables.pop(request_id, None)
        self._pending.pop(request_id, None)
        if tables:
            for table in tables:
                self._free.extend(table)

    def tables(self, request_id: str) -> list[list[int]]:
        return self._tables.get(request_id, [])

    def take_deltas(self) -> list[BlockDelta]:
        """Blocks appended since the last call, for the next batch to carry."""
        deltas = [
            BlockDelta(request_id=rid, plane_blocks=planes) for rid, planes in self._pending.items()
        ]
        self._pending = {}
        return deltas

    def check_consistency(self) -> None:
        """Every block is free or held exactly once (tests call this)."""
        held = [b for tables in self._tables.values() for t in tables for b in t]
        everything = held + list(self._free)
        if sorted(everything) != list(range(self.num_blocks)):
            raise AssertionError("KV blocks leaked or double-owned")
