"""Producer side of ordered prefix publication: the epoch and the per-producer event_seq.

Epochs are 32 hex chars like a uuid, but time-ordered (UUIDv7-style: nanosecond clock, then
random bits), so a consumer can tell a newer epoch from a late envelope of an older one. A new
producer process calls ``announce()`` once, so consumers drop what its previous epoch published
even before it caches anything. (A wall clock stepped back across a restart by more than the
restart takes would make the new epoch look old; consumers then need ``drop_producer``.)

The log keeps no events: they wait in the KV manager (the one buffer, ``AllBlocksCleared``
after a worker loss or at a producer's start included) until ``Scheduler.take_prefix_events``
wraps them here into the next envelope, which its caller must publish: a seq that is emitted
but never published is a gap, which costs the consumer the producer's blocks. Keeping and
replaying envelopes is the JetStream event stream's job (``prefix_publisher.py``), not this
log's. One case is left to the producer: when envelopes could not be published at all (the
bus was gone longer than the publisher may buffer), ``rebase(snapshot)`` starts a NEW epoch
whose seq 1 carries ``AllBlocksCleared`` + the full cache (the KV manager's
``snapshot_prefix_events``); consumers drop the old epoch on sight and converge on it.
"""

from __future__ import annotations

import secrets
import time

from messages.prefix import AllBlocksCleared, PrefixEvent, PrefixEventBatch


def new_epoch(after: str | None = None) -> str:
    """A fresh epoch that sorts after every earlier one (and after ``after`` if given)."""
    epoch = f"{time.time_ns():016x}{secrets.randbits(64):016x}"
    if after is not None and epoch <= after and len(after) == 32:
        # clock did not move past ``after``: keep its time part, bump the rest
        epoch = f"{int(after, 16) + 1:032x}"
    return epoch


class PrefixEventLog:
    def __init__(self, producer_id: str, epoch: str | None = None) -> None:
        self.producer_id = producer_id
        self.epoch = epoch if epoch is not None else new_epoch()
        self._last_seq = 0  # seqs start at 1 in every epoch

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def emit(self, events: list[PrefixEvent]) -> PrefixEventBatch | None:
        """Wraps ``events`` in the next envelope; None for nothing to say (no seq used)."""
        if not events:
            return None
        self._last_seq += 1
        return PrefixEventBatch(
            producer_id=self.producer_id,
            epoch=self.epoch,
            event_seq=self._last_seq,
            events=list(events),
        )

    def announce(self) -> PrefixEventBatch:
        """First envelope of a new producer process: nothing of its older epochs survives.
        (The scheduler says it through its KV manager's buffer, like every other event.)"""
        batch = self.emit([AllBlocksCleared()])
        assert batch is not None
        return batch

    def rebase(self, snapshot: list[PrefixEvent]) -> PrefixEventBatch:
        """New epoch whose seq 1 is ``AllBlocksCleared`` + ``snapshot`` (the full state),
        for the caller to publish at once.

        Drain pending events before taking the snapshot (it holds their effect); events
        emitted after this are ordinary deltas on top of it.
        """
        self.epoch = new_epoch(after=self.epoch)
        self._last_seq = 0
        head: list[PrefixEvent] = [AllBlocksCleared()]
        batch = self.emit(head + [e for e in snapshot if not isinstance(e, AllBlocksCleared)])
        assert batch is not None
        return batch
