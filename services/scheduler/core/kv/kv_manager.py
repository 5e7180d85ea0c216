"""Logical depth-aware paged KV: block tables, free list, and the deltas the worker mirrors.

Every plane of a request grows in lockstep (a position gets a slot in all planes at once),
because a LAST_EXITED exit copy writes the token's slot in every higher plane.

Prefix caching (``enable_prefix_caching``): the cached unit is a block GROUP, logical block i
of a request = one physical block in EVERY plane (a looped model's prefix KV lives at every
depth). A published group is keyed by its chain hash and ref-counted (one ref per request
table holding it). At ref 0 a cached group is not freed but parked in an LRU evictable set;
allocation takes the free list first, then evicts the least recently used parked groups.

``num_free_blocks`` counts free + evictable blocks: both are what ``ensure`` can hand out, so
capacity checks stay right. ``num_evictable_blocks`` gives the parked part alone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from messages.batch import BlockDelta
from messages.prefix import AllBlocksCleared, BlockRemoved, BlockStored, PrefixEvent
from services.common.fit import KVGeometry, blocks_per_plane


@dataclass(eq=False)
class _Group:
    """A published block group: one physical block per plane, shared through ``ref_count``."""

    blocks: tuple[int, ...]
    block_hash: int
    parent_hash: int | None
    batch_seq: int
    ref_count: int
    writer: str = ""  # the request whose rows wrote it (others only claimed it)
    cached: bool = True  # False once detached (reset, withdrawn): held, never claimable again


class KVManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_planes: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self.enable_prefix_caching = enable_prefix_caching
        self.geometry = KVGeometry(block_size, num_blocks, num_planes)
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[list[int]]] = {}
        self._pending: dict[str, list[list[int]]] = {}
        # prefix caching state (all empty while caching is off)
        self._groups: dict[int, _Group] = {}  # plane-0 block -> its published group
        self._by_hash: dict[int, _Group] = {}  # claimable groups
        self._evictable: OrderedDict[int, _Group] = OrderedDict()  # hash -> ref-0 group, LRU first
        self._events: list[PrefixEvent] = []

    # capacity -------------------------------------------------------------------------
    def blocks_per_plane(self, num_tokens: int) -> int:
        return self.geometry.blocks_per_plane(num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        return self.geometry.blocks_for(num_tokens)

    def blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """Blocks ``ensure(request_id, num_tokens)`` would allocate (off its hot path)."""
        tables = self._tables.get(request_id)
        have = len(tables[0]) if tables else 0
        return max(0, self.blocks_per_plane(num_tokens) - have) * self.num_planes

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``ensure`` can hand out: truly free + cache-only (evictable)."""
        return len(self._free) + self.num_evictable_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable) * self.num_planes

    def num_held_blocks(self, request_id: str) -> int:
        tables = self._tables.get(request_id)
        return sum(len(t) for t in tables) if tables else 0

    def releasable_blocks(self, request_ids: Collection[str]) -> int:
        """Blocks ``free`` of all these requests would make allocatable: their private
        blocks and the shared groups no one else holds (a group another request still
        holds frees nothing, so preempting for it would only throw work away)."""
        wanted = set(request_ids)
        private = 0
        holders: dict[int, int] = {}  # plane-0 block of a shared group -> holders among them
        for request_id in wanted:
            tables = self._tables.get(request_id)
            if not tables:
                continue
            for block in tables[0]:
                if block in self._groups:
                    holders[block] = holders.get(block, 0) + 1
                else:
                    private += self.num_planes
        shared = sum(
            len(self._groups[b].blocks)
            for b, n in holders.items()
            if n == self._groups[b].ref_count
        )
        return private + shared

    # allocation -----------------------------------------------------------------------
    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's tables to cover ``num_tokens`` positions; all or nothing.

        Evicts LRU cache-only groups only when that makes the whole allocation succeed.
        """
        tables = self._tables.get(request_id)
        have = len(tables[0]) if tables else 0
        want = blocks_per_plane(num_tokens, self.block_size)
        if want <= have:
            return True
        needed = (want - have) * self.num_planes
        if needed > len(self._free):
            if needed > self.num_free_blocks:
                return False  # even eviction cannot satisfy it: evict nothing
            while len(self._free) < needed:
                self._evict(next(iter(self._evictable.values())))
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
        if not tables:
            return
        if not self._groups:  # nothing shared: the original plane-by-plane release
            for table in tables:
                self._free.extend(table)
            return
        private: list[list[int]] = [[] for _ in tables]
        # Tail first, so within one request the tail is parked (and evicted) before its prefix.
        for i in reversed(range(len(tables[0]))):
            group = self._groups.get(tables[0][i])
            if group is None:
                for plane, table in enumerate(tables):
                    private[plane].append(table[i])
            else:
                self._release(group)
        for blocks in private:
            self._free.extend(reversed(blocks))

    def tables(self, request_id: str) -> list[list[int]]:
        return self._tables.get(request_id, [])

    # held blocks (disaggregation: a handoff's prompt KV, a pull's landing blocks) --------
    # A holder is a key in the tables that the worker never hears of: its blocks are used,
    # not free, and ``free(holder)`` gives them back like a request's (shared groups too).
    def detach(self, request_id: str, holder: str) -> list[list[int]]:
        """Moves the request's blocks to ``holder`` (the request is gone, its KV stays)."""
        tables = self._tables.pop(request_id, [])
        self._pending.pop(request_id, None)
        if tables:
            self._tables[holder] = tables
        return tables

    def reserve(self, holder: str, blocks_per_plane: int) -> list[list[int]] | None:
        """``blocks_per_plane`` fresh blocks in every plane under ``holder``; None (nothing
        taken) if they do not fit."""
        if not self.ensure(holder, blocks_per_plane * self.block_size):
            return None
        self._pending.pop(holder, None)
        return self._tables[holder]

    def attach(self, holder: str, request_id: str) -> None:
        """Appends ``holder``'s blocks to the request's tables (and to its next delta)."""
        blocks = self._tables.pop(holder, None)
        if not blocks:
            return
        tables = self._tables.setdefault(request_id, [[] for _ in range(self.num_planes)])
        pending = self._pending.setdefault(request_id, [[] for _ in range(self.num_planes)])
        for table, delta, new in zip(tables, pending, blocks, strict=True):
            table.extend(new)
            delta.extend(new)

    def take_deltas(self) -> list[BlockDelta]:
        """Blocks appended since the last call, for the next batch to carry."""
        deltas = [
            BlockDelta(request_id=rid, plane_blocks=planes) for rid, planes in self._pending.items()
        ]
        self._pending = {}
        return deltas

    # prefix caching -------------------------------------------------------------------
    def lookup_prefix(
        self, block_hashes: Sequence[int], before_batch_seq: int | None = None
    ) -> int:
        """Leading hashes currently cached (pass only blocks before the last prompt token)."""
        return len(self._leading_groups(block_hashes, before_batch_seq))

    def claimable_prefix(
        self, block_hashes: Sequence[int], before_batch_seq: int | None = None
    ) -> tuple[int, int]:
        """(groups ``claim_prefix`` would attach now, how many of them are parked). A parked
        group leaves the free count when claimed: admission checks weigh both, claiming nothing."""
        groups = self._leading_groups(block_hashes, before_batch_seq)
        return len(groups), sum(1 for g in groups if g.ref_count == 0)

    def claim_prefix(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        before_batch_seq: int | None = None,
    ) -> int:
        """Attaches the longest cached leading run to the request's empty tables.

        May return less than an earlier lookup (evicted since): a shorter hit, never wrong KV.
        ``before_batch_seq`` skips groups written by that batch or later (not yet readable).
        The claimed blocks go into the pending deltas like appended ones.
        """
        held = self._tables.get(request_id)
        if held and held[0]:
            raise ValueError(f"claim_prefix({request_id!r}) needs empty tables")
        groups = self._leading_groups(block_hashes, before_batch_seq)
        if not groups:
            return 0
        tables = self._tables[request_id] = [[] for _ in range(self.num_planes)]
        pending = self._pending.setdefault(request_id, [[] for _ in range(self.num_planes)])
        for group in groups:
            if group.ref_count == 0:
                del self._evictable[group.block_hash]  # in use again; re-parked at the MRU end
            group.ref_count += 1
            for plane, block in enumerate(group.blocks):
                tables[plane].append(block)
                pending[plane].append(block)
        return len(groups)

    def publish(
        self,
        request_id: str,
        block_index: int,
        block_hash: int,
        parent_hash: int | None,
        batch_seq: int,
    ) -> None:
        """Caches the request's block group ``block_index`` (fully written by ``batch_seq``).

        If another group already caches ``block_hash``, that one stays and ours stays private.
        """
        if not self.enable_prefix_caching:
            return
        tables = self._tables.get(request_id)
        if not tables or not 0 <= block_index < len(tables[0]):
            raise ValueError(f"request {request_id!r} has no block {block_index} to publish")
        existing = self._groups.get(tables[0][block_index])
        if existing is not None:
            if existing.block_hash != block_hash:
                raise ValueError(
                    f"block {block_index} of {request_id!r} is already published under another hash"
                )
            return  # claimed or published before (or detached by a reset: stays detached)
        if block_hash in self._by_hash:
            return
        group = _Group(
            blocks=tuple(table[block_index] for table in tables),
            block_hash=block_hash,
            parent_hash=parent_hash,
            batch_seq=batch_seq,
            ref_count=1,  # private until now, so its only holder is this request
            writer=request_id,
        )
        self._groups[group.blocks[0]] = group
        self._by_hash[block_hash] = group
        self._record_stored(group)

    def withdraw(self, writers: Collection[str], since_batch_seq: int) -> list[str]:
        """Un-publishes the groups ``writers`` published from batch ``since_batch_seq`` on,
        because a batch that wrote them failed: nobody can claim them any more (the index
        hears BlockRemoved). Returns the other requests that hold one of them: they read KV
        that was never written and must be recomputed."""
        doomed = {
            key: g
            for key, g in self._groups.items()
            if g.cached and g.writer in writers and g.batch_seq >= since_batch_seq
        }
        if not doomed:
            return []
        for key, group in doomed.items():
            del self._by_hash[group.block_hash]
            group.cached = False
            if group.ref_count == 0:  # parked: nobody holds it, free it now
                del self._evictable[group.block_hash]
                del self._groups[key]
                self._free.extend(group.blocks)
        self._events.append(BlockRemoved(block_hashes=[g.block_hash for g in doomed.values()]))
        return [
            rid
            for rid, tables in self._tables.items()
            if tables and any(block in doomed for block in tables[0])
        ]

    def take_prefix_events(self) -> list[PrefixEvent]:
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block: parked groups are freed, groups in use are detached
        (their holders keep them, nobody new can claim them)."""
        if not self.enable_prefix_caching:
            return
        for group in self._evictable.values():
            del self._groups[group.blocks[0]]
            self._free.extend(group.blocks)
        self._evictable.clear()
        for group in self._by_hash.values():
            group.cached = False
        self._by_hash.clear()
        # earlier undelivered events are superseded by the clear
        self._events = [AllBlocksCleared()]

    def cached_block_hashes(self) -> set[int]:
        return set(self._by_hash)

    def snapshot_prefix_events(self) -> list[PrefixEvent]:
        """The whole cache as events, for a producer-log rebase (see prefix_events.py)."""
        snapshot: list[PrefixEvent] = [AllBlocksCleared()]
        snapshot.extend(
            BlockStored(
                block_hashes=[g.block_hash],
                parent_hash=g.parent_hash,
                num_tokens_per_block=self.block_size,
                batch_seq=g.batch_seq,
            )
            for g in self._by_hash.values()
        )
        return snapshot

    def _leading_groups(
        self, block_hashes: Sequence[int], before_batch_seq: int | None
    ) -> list[_Group]:
        groups: list[_Group] = []
        for block_hash in block_hashes:
            group = self._by_hash.get(block_hash)
            if group is None:
                break
            if before_batch_seq is not None and group.batch_seq >= before_batch_seq:
                break  # written by a batch that has not run before the reader's batch
            groups.append(group)
        return groups

    def _release(self, group: _Group) -> None:
        group.ref_count -= 1
        if group.ref_count > 0:
            return
        if group.cached:
            self._evictable[group.block_hash] = group  # most recently used end
        else:
            del self._groups[group.blocks[0]]
            self._free.extend(group.blocks)

    def _evict(self, group: _Group) -> None:
        del self._evictable[group.block_hash]
        del self._by_hash[group.block_hash]
        del self._groups[group.blocks[0]]
        self._free.extend(group.blocks)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # coalesce one allocation's evictions
            last.block_hashes.append(group.block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[group.block_hash]))

    def _record_stored(self, group: _Group) -> None:
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.batch_seq == group.batch_seq
            and last.block_hashes[-1] == group.parent_hash
        ):  # extend a chain published by the same batch
            last.block_hashes.append(group.block_hash)
        else:
            self._events.append(
                BlockStored(
                    block_hashes=[group.block_hash],
                    parent_hash=group.parent_hash,
                    num_tokens_per_block=self.block_size,
                    batch_seq=group.batch_seq,
                )
            )

    # invariants -----------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Every block is free, parked (evictable) or held, exactly once; shared groups are
        held by exactly ``ref_count`` tables (tests call this)."""
        refs: dict[int, int] = {}
        private: list[int] = []
        for rid, tables in self._tables.items():
            if len(tables) != self.num_planes or len({len(t) for t in tables}) > 1:
                raise AssertionError(f"planes of {rid!r} out of lockstep")
            for i in range(len(tables[0]) if tables else 0):
                group = self._groups.get(tables[0][i])
                if group is None:
                    private.extend(t[i] for t in tables)
                    continue
                if tuple(t[i] for t in tables) != group.blocks:
                    raise AssertionError(f"{rid!r} holds a torn block group at index {i}")
                refs[group.blocks[0]] = refs.get(group.blocks[0], 0) + 1
        held_groups: list[int] = []
        for key, group in self._groups.items():
            if key != group.blocks[0] or refs.get(key, 0) != group.ref_count:
                raise AssertionError(f"group {group.block_hash:#x} ref count is wrong")
            parked = self._evictable.get(group.block_hash) is group
            if parked != (group.ref_count == 0) or (parked and not group.cached):
                raise AssertionError(f"group {group.block_hash:#x} parked wrongly")
            if group.cached != (self._by_hash.get(group.block_hash) is group):
                raise AssertionError(f"group {group.block_hash:#x} hash map is stale")
            if group.ref_count > 0:
                held_groups.extend(group.blocks)
        if len(self._by_hash) != sum(g.cached for g in self._groups.values()):
            raise AssertionError("hash map holds unknown groups")
        parked_blocks = [b for g in self._evictable.values() for b in g.blocks]
        everything = list(self._free) + parked_blocks + private + held_groups
        if sorted(everything) != list(range(self.num_blocks)):
            raise AssertionError("KV blocks leaked or double-owned")
