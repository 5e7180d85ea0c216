"""Pure prefix index (no NATS): applies each producer's events strictly in event_seq order.

The events come from one JetStream stream in publish order, so what a producer published
arrives in seq order, and a seq that is missing when a later one arrives will never come: it
aged out of the stream, or the producer could not publish it. The index then drops that
producer's blocks and goes on from the later envelope. What it holds afterwards was stored by
envelopes it saw, and any removal of such a block comes after them, so a gap costs misses,
never a wrong hit. Seqs at or below the applied one are duplicates (a re-delivery) and ignored.

Epochs sort in time order (``services.scheduler.core.kv.prefix_events.new_epoch``): a greater epoch
drops the producer's blocks first; a smaller one is a late envelope of a dead epoch and is
ignored. ``forget_all`` drops every producer's blocks: for holes in the stream itself (which
producers they hit is unknown). ``to_snapshot`` / ``from_snapshot`` persist the whole index.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from messages.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixEventBatch,
    PrefixIndexSnapshot,
    PrefixLookupReply,
    ProducerSnapshot,
)

_SWAP = sys.byteorder != "little"


@dataclass
class ApplyOutcome:
    applied: bool = False  # the envelope's events were applied
    duplicate: bool = False  # applied before (a re-delivery); ignored
    stale_epoch: bool = False  # from an epoch older than the producer's current one; ignored
    new_epoch: bool = False  # the producer's old epoch was dropped
    dropped: bool = False  # from an epoch of a producer dropped as gone; ignored
    gap: bool = False  # envelopes were missing: the producer's blocks were dropped first


@dataclass
class _Producer:
    epoch: str
    event_seq: int = 0  # the last envelope applied whole
    next_part: int = 0  # parts of envelope event_seq + 1 applied already
    blocks: set[int] = field(default_factory=set)

    def expects(self) -> tuple[int, int]:
        return self.event_seq + 1, self.next_part


class PrefixIndex:
    def __init__(self) -> None:
        self._producers: dict[str, _Producer] = {}
        self._holders: dict[int, set[str]] = {}  # block hash -> producers caching it
        # producers dropped as gone -> the epoch they had: the unread rest of that epoch
        # (a backlog) must not bring their blocks back; a later epoch (a restart) or a
        # report from them (``revive``: they were only silent) lifts it
        self._dropped: dict[str, str] = {}
        self.stream_seq = 0  # the last stream message applied (kept by the NATS shell)
        self.num_gaps = 0
        # changes not made by a stream message (a producer dropped, everything forgotten):
        # a snapshot is due after them too, though stream_seq did not move
        self.num_local_changes = 0

    # ------------------------------------------------------------------ events in
    def apply(self, batch: PrefixEventBatch) -> ApplyOutcome:
        pid = batch.producer_id
        state = self._producers.get(pid)
        outcome = ApplyOutcome()
        dropped = self._dropped.get(pid)
        if dropped is not None:
            if batch.epoch <= dropped:
                outcome.dropped = True
                return outcome
            del self._dropped[pid]  # it came back as a new incarnation
        if state is None:
            state = self._producers[pid] = _Producer(epoch=batch.epoch)
        elif batch.epoch < state.epoch:
            outcome.stale_epoch = True
            return outcome
        elif batch.epoch > state.epoch:
            self._clear_blocks(pid, state)
            self._producers[pid] = state = _Producer(epoch=batch.epoch)
            outcome.new_epoch = True
        position, expected = (batch.event_seq, batch.part), state.expects()
        if position < expected:
            outcome.duplicate = True
            return outcome
        if position > expected:
            outcome.gap = True
            self.num_gaps += 1
            self._clear_blocks(pid, state)
        self._apply_events(pid, state, batch)
        if batch.part + 1 >= batch.num_parts:
            state.event_seq, state.next_part = batch.event_seq, 0
        else:
            state.event_seq, state.next_part = batch.event_seq - 1, batch.part + 1
        outcome.applied = True
        return outcome

    def forget_all(self) -> None:
        """Drops every producer's blocks (their epochs and positions stay): the stream lost
        messages and nobody can tell whose."""
        for pid, state in self._producers.items():
            self._clear_blocks(pid, state)
        self.num_local_changes += 1

    def drop_producer(self, producer_id: str) -> None:
        """Forgets a producer that went away, and ignores what is left of its epoch."""
        state = self._producers.pop(producer_id, None)
        if state is not None:
            self._clear_blocks(producer_id, state)
            self._dropped[producer_id] = state.epoch
            self.num_local_changes += 1

    def revive(self, producer_id: str) -> bool:
        """A dropped producer turned out to be alive (it reports again): its envelopes are
        applied again (from a gap: what it stored meanwhile was not seen). True if it had
        been dropped."""
        if self._dropped.pop(producer_id, None) is None:
            return False
        self.num_local_changes += 1
        return True

    def producers(self) -> list[str]:
        return list(self._producers)

    # ------------------------------------------------------------------ queries
    def lookup(self, block_hashes: Sequence[int], per_producer: bool = False) -> PrefixLookupReply:
        """Longest leading run cached by ONE producer (KV cannot be stitched across
        producers); ties go to the lowest producer id. ``per_producer`` also gives every
        producer's own leading run (the router weighs each shard's overlap)."""
        overlaps = self.overlaps(block_hashes)
        if not overlaps:
            return PrefixLookupReply()
        matched = max(overlaps.values())
        pid = min(p for p, n in overlaps.items() if n == matched)
        return PrefixLookupReply(
            producer_id=pid,
            num_blocks=matched,
            event_seq=self._producers[pid].event_seq,
            overlaps=overlaps if per_producer else {},
        )

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """{producer: how many leading blocks of ``block_hashes`` it caches}, producers with
        none left out. One walk down the chain: a producer drops out at its first miss."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for matched, block_hash in enumerate(block_hashes):
            holders = self._holders.get(block_hash)
            if alive is None:
                alive = set(holders) if holders else set()
            else:
                still = alive & holders if holders else set()
                for pid in alive - still:
                    out[pid] = matched
                alive = still
            if not alive:
                return out
        for pid in alive or ():
            out[pid] = len(block_hashes)
        return out

    def applied_seq(self, producer_id: str) -> int:
        state = self._producers.get(producer_id)
        return state.event_seq if state else 0

    def epoch(self, producer_id: str) -> str | None:
        state = self._producers.get(producer_id)
        return state.epoch if state else None

    def cached_blocks(self) -> dict[str, set[int]]:
        """{producer: cached hashes}, producers with nothing cached left out."""
        return {pid: set(st.blocks) for pid, st in self._producers.items() if st.blocks}

    def num_blocks(self) -> int:
        return sum(len(st.blocks) for st in self._producers.values())

    # ------------------------------------------------------------------ persistence
    def to_snapshot(self) -> PrefixIndexSnapshot:
        return PrefixIndexSnapshot(
            stream_seq=self.stream_seq,
            producers=[
                ProducerSnapshot(
                    producer_id=pid,
                    epoch=st.epoch,
                    event_seq=st.event_seq,
                    next_part=st.next_part,
                    blocks=_pack(st.blocks),
                )
                for pid, st in self._producers.items()
            ],
            dropped=dict(self._dropped),
            written_at=time.time(),
        )

    @classmethod
    def from_snapshot(cls, snapshot: PrefixIndexSnapshot) -> PrefixIndex:
        index = cls()
        index.stream_seq = snapshot.stream_seq
        index._dropped = dict(snapshot.dropped)
        for ps in snapshot.producers:
            blocks = _unpack(ps.blocks)
            index._producers[ps.producer_id] = _Producer(
                epoch=ps.epoch, event_seq=ps.event_seq, next_part=ps.next_part, blocks=blocks
            )
            for block_hash in blocks:
                index._holders.setdefault(block_hash, set()).add(ps.producer_id)
        return index

    # ------------------------------------------------------------------ internals
    def _apply_events(self, pid: str, state: _Producer, batch: PrefixEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    state.blocks.add(block_hash)
                    self._holders.setdefault(block_hash, set()).add(pid)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash in state.blocks:
                        state.blocks.discard(block_hash)
                        self._unhold(block_hash, pid)
            elif isinstance(event, AllBlocksCleared):
                self._clear_blocks(pid, state)

    def _clear_blocks(self, pid: str, state: _Producer) -> None:
        for block_hash in state.blocks:
            self._unhold(block_hash, pid)
        state.blocks.clear()

    def _unhold(self, block_hash: int, pid: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(pid)
            if not holders:
                del self._holders[block_hash]


def _pack(blocks: set[int]) -> bytes:
    packed = array("Q", sorted(blocks))
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes) -> set[int]:
    if len(data) % 8:
        raise ValueError(f"packed block hashes of {len(data)} bytes (not a multiple of 8)")
    packed = array("Q")
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return set(packed)
