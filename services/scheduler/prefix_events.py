"""Producer side of ordered prefix publication: event_seq, epoch and a bounded replay log.

Epochs are 32 hex chars like a uuid, but time-ordered (UUIDv7-style: nanosecond clock, then
random bits), so a consumer can tell a newer epoch from a late envelope of an older one. A new
producer process calls ``announce()`` once, so consumers drop what its previous epoch published
even before it caches anything. (A wall clock stepped back across a restart by more than the
restart takes would make the new epoch look old; consumers then need ``drop_producer``.)

Overflow choice: when a consumer asks to replay seqs that have already fallen out of the
bounded log, the log cannot rebuild them, so ``replay`` raises ``ReplayUnavailable``. The
caller then calls ``rebase(snapshot)`` with a full snapshot of what it has cached (the KV
manager's ``snapshot_prefix_events``): that starts a NEW epoch whose seq 1 carries
``AllBlocksCleared`` + the snapshot. Every consumer drops the old epoch on sight and
applies seq 1, so the gap can never wedge a consumer and lagging replicas converge too.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable

from messages.prefix import AllBlocksCleared, PrefixEvent, PrefixEventBatch, ReplayRequest


def new_epoch(after: str | None = None) -> str:
    """A fresh epoch that sorts after every earlier one (and after ``after`` if given)."""
    epoch = f"{time.time_ns():016x}{secrets.randbits(64):016x}"
    if after is not None and epoch <= after and len(after) == 32:
        # clock did not move past ``after``: keep its time part, bump the rest
        epoch = f"{int(after, 16) + 1:032x}"
    return epoch


class ReplayUnavailable(Exception):
    """``from_seq`` is older than the oldest envelope still in the log."""

    def __init__(self, from_seq: int, oldest_seq: int) -> None:
        super().__init__(f"replay from seq {from_seq} impossible: log starts at {oldest_seq}")
        self.from_seq = from_seq
        self.oldest_seq = oldest_seq


class PrefixEventLog:
    def __init__(self, producer_id: str, epoch: str | None = None, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.producer_id = producer_id
        self.epoch = epoch if epoch is not None else new_epoch()
        self.capacity = capacity
        self._log: deque[PrefixEventBatch] = deque(maxlen=capacity)
        self._last_seq = 0  # seqs start at 1 in every epoch

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def emit(self, events: list[PrefixEvent]) -> PrefixEventBatch | None:
        """Wraps ``events`` in the next envelope; None for nothing to say (no seq used)."""
        if not events:
            return None
        self._last_seq += 1
        batch = PrefixEventBatch(
            producer_id=self.producer_id,
            epoch=self.epoch,
            event_seq=self._last_seq,
            events=list(events),
        )
        self._log.append(batch)
        return batch

    def announce(self) -> PrefixEventBatch:
        """First envelope of a new producer process: nothing of its older epochs survives."""
        batch = self.emit([AllBlocksCleared()])
        assert batch is not None
        return batch

    def latest(self) -> PrefixEventBatch | None:
        """The newest envelope, for periodic re-publication: a consumer that missed the tail
        sees a gap and asks for a replay; one that did not drops it as a duplicate."""
        return self._log[-1] if self._log else None

    def replay(self, from_seq: int) -> list[PrefixEventBatch]:
        """Envelopes ``from_seq`` .. newest; raises ReplayUnavailable if they left the log."""
        if from_seq > self._last_seq:
            return []
        oldest = self._log[0].event_seq if self._log else self._last_seq + 1
        if from_seq < oldest:
            raise ReplayUnavailable(from_seq, oldest)
        return list(self._log)[from_seq - oldest :]

    def rebase(self, snapshot: list[PrefixEvent]) -> PrefixEventBatch:
        """New epoch whose seq 1 is ``AllBlocksCleared`` + ``snapshot`` (the full state).

        Drain pending events into the log before taking the snapshot; events emitted after
        this are ordinary deltas on top of it.
        """
        self.epoch = new_epoch(after=self.epoch)
        self._log.clear()
        self._last_seq = 0
        head: list[PrefixEvent] = [AllBlocksCleared()]
        batch = self.emit(head + [e for e in snapshot if not isinstance(e, AllBlocksCleared)])
        assert batch is not None
        return batch

    def answer(
        self, request: ReplayRequest, snapshot: Callable[[], list[PrefixEvent]]
    ) -> list[PrefixEventBatch]:
        """What to publish for a consumer's ReplayRequest (replay, or a rebase if too old)."""
        if request.producer_id != self.producer_id or request.epoch != self.epoch:
            # A request about an older epoch: the consumer learns the current one from the
            # stream (or from ``latest``), then asks again within it.
            return []
        try:
            return self.replay(max(request.from_seq, 1))
        except ReplayUnavailable:
            return [self.rebase(snapshot())]
