"""What one call into ``SchedulerDriver`` leaves for the NATS shell to send.

Every driver call that can change what others must hear returns one ``StepOutput``; the
shell publishes it in one place (``SchedulerService._publish``). Nothing here touches NATS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from messages.api import StreamEvent
from messages.internal import RelayedEvent, RequestNotice, WorkerBatch
from messages.kv_transfer import KVHandoff
from messages.prefix import PrefixEventBatch

# one try of a request: (admission id, admission seq); a stream serves one, fencing and
# aimed aborts name one
StreamKey = tuple[str, int]
# (the abort requester's reply subject, its answer): the only events not relayed
Delivery = tuple[str, StreamEvent]
# (admission's tracking subject, notice)
Notice = tuple[str, RequestNotice]


class Relay(NamedTuple):
    """One stream event for admission to pass on to its client."""

    subject: str  # the admission's relay subject
    admission_id: str
    item: RelayedEvent

    @property
    def key(self) -> StreamKey:
        return (self.admission_id, self.item.seq)


@dataclass
class StepOutput:
    # batches for the bound worker, in seq order (the worker is the critical path)
    batches: list[WorkerBatch] = field(default_factory=list)
    # stream events for admission, in the order they happened
    relays: list[Relay] = field(default_factory=list)
    # answers to abort requesters (never a request's outputs: those are relayed)
    deliveries: list[Delivery] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    # prefix-event envelopes for the JetStream event stream, in event_seq order
    prefix_events: list[PrefixEventBatch] = field(default_factory=list)
    # handoffs this (decode) shard will not read: released at their prefill schedulers
    kv_releases: list[KVHandoff] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.batches
            or self.relays
            or self.deliveries
            or self.notices
            or self.prefix_events
            or self.kv_releases
        )

    def extend(self, other: StepOutput) -> None:
        """Appends ``other`` (which happened after this)."""
        self.batches += other.batches
        self.relays += other.relays
        self.deliveries += other.deliveries
        self.notices += other.notices
        self.prefix_events += other.prefix_events
        self.kv_releases += other.kv_releases
