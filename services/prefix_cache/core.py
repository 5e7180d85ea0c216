"""Pure prefix index (no NATS): applies each producer's events strictly in event_seq order.

Per producer: envelopes apply in seq order starting at 1 of the current epoch; later ones are
buffered and the gap is reported as a ReplayRequest; already-applied (or already-buffered)
seqs are ignored, so re-delivery is idempotent. Epochs sort in time order (see
``services.scheduler.prefix_events.new_epoch``): a greater epoch drops the producer's blocks and
buffer first; a smaller one is a late envelope of a dead epoch and is ignored, whichever of the
two arrives first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from messages.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixEventBatch,
    PrefixLookupReply,
    ReplayRequest,
)


@dataclass
class ApplyOutcome:
    applied_seqs: list[int] = field(default_factory=list)  # applied by this call, in order
    duplicate: bool = False  # this envelope was applied or buffered before
    stale_epoch: bool = False  # from an epoch older than the producer's current one; ignored
    new_epoch: bool = False  # the producer's old epoch was dropped
    replay: ReplayRequest | None = None  # send this to the producer to fill a gap


@dataclass
class _Producer:
    epoch: str
    applied_seq: int = 0
    blocks: set[int] = field(default_factory=set)
    buffer: dict[int, PrefixEventBatch] = field(default_factory=dict)
    asked_from: int = 0  # last from_seq requested, so a burst of late envelopes asks once

    def gap(self, producer_id: str) -> ReplayRequest | None:
        if not self.buffer:
            return None
        return ReplayRequest(
            producer_id=producer_id, epoch=self.epoch, from_seq=self.applied_seq + 1
        )


class PrefixIndex:
    def __init__(self, max_buffered: int = 4096) -> None:
        self.max_buffered = max_buffered
        self._producers: dict[str, _Producer] = {}
        self._holders: dict[int, set[str]] = {}  # block hash -> producers caching it

    # ------------------------------------------------------------------ events in
    def apply(self, batch: PrefixEventBatch) -> ApplyOutcome:
        pid = batch.producer_id
        state = self._producers.get(pid)
        outcome = ApplyOutcome()
        if state is None:
            state = self._producers[pid] = _Producer(epoch=batch.epoch)
        elif batch.epoch < state.epoch:
            outcome.stale_epoch = True
            return outcome
        elif batch.epoch > state.epoch:
            self._start_epoch(pid, state, batch.epoch)
            outcome.new_epoch = True
        seq = batch.event_seq
        if seq <= state.applied_seq:
            outcome.duplicate = True
            return outcome
        if seq in state.buffer:
            # a re-sent envelope still stuck behind the gap: our replay request may be lost
            outcome.duplicate = True
            outcome.replay = state.gap(pid)
            return outcome
        if seq > state.applied_seq + 1:
            self._buffer(state, batch)
        else:
            self._apply_one(pid, state, batch)
            outcome.applied_seqs.append(seq)
            while (nxt := state.buffer.pop(state.applied_seq + 1, None)) is not None:
                self._apply_one(pid, state, nxt)
                outcome.applied_seqs.append(nxt.event_seq)
        gap = state.gap(pid)
        if gap is not None and gap.from_seq != state.asked_from:
            state.asked_from = gap.from_seq
            outcome.replay = gap
        return outcome

    def pending_replays(self) -> list[ReplayRequest]:
        """Every open gap, for a timer to re-ask (a ReplayRequest or its answer can be lost)."""
        gaps = (state.gap(pid) for pid, state in self._producers.items())
        return [gap for gap in gaps if gap is not None]

    def drop_producer(self, producer_id: str) -> None:
        """Forgets a producer (e.g. it went away for good)."""
        state = self._producers.pop(producer_id, None)
        if state is not None:
            self._clear_blocks(producer_id, state)

    # ------------------------------------------------------------------ queries
    def lookup(self, block_hashes: Sequence[int]) -> PrefixLookupReply:
        """Longest leading run cached by ONE producer (KV cannot be stitched across
        producers); ties go to the lowest producer id."""
        candidates: set[str] = set()
        matched = 0
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if not holders:
                break
            narrowed = set(holders) if matched == 0 else candidates & holders
            if not narrowed:
                break
            candidates = narrowed
            matched += 1
        if matched == 0:
            return PrefixLookupReply()
        pid = min(candidates)
        return PrefixLookupReply(
            producer_id=pid, num_blocks=matched, event_seq=self._producers[pid].applied_seq
        )

    def applied_seq(self, producer_id: str) -> int:
        state = self._producers.get(producer_id)
        return state.applied_seq if state else 0

    def epoch(self, producer_id: str) -> str | None:
        state = self._producers.get(producer_id)
        return state.epoch if state else None

    def snapshot(self) -> dict[str, set[int]]:
        """{producer: cached hashes}, producers with nothing cached left out (for tests)."""
        return {pid: set(st.blocks) for pid, st in self._producers.items() if st.blocks}

    # ------------------------------------------------------------------ internals
    def _start_epoch(self, pid: str, state: _Producer, epoch: str) -> None:
        self._clear_blocks(pid, state)
        state.epoch = epoch
        state.applied_seq = 0
        state.buffer.clear()
        state.asked_from = 0

    def _buffer(self, state: _Producer, batch: PrefixEventBatch) -> None:
        if len(state.buffer) >= self.max_buffered:
            furthest = max(state.buffer)
            if batch.event_seq > furthest:
                return  # the replay of the gap re-sends it
            del state.buffer[furthest]
        state.buffer[batch.event_seq] = batch

    def _apply_one(self, pid: str, state: _Producer, batch: PrefixEventBatch) -> None:
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
        state.applied_seq = batch.event_seq

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
