"""Sharing a prefix that is still being prefilled (``SchedulerConfig.share_inflight_prefill``).

A block is published for reuse only once the final depth has passed it, so requests that
arrive together with a new system prompt would each compute it. Instead, a waiting request
whose first unclaimable prompt block a running prefill is writing is *parked* on that block
until the writer publishes it or stops writing it (finished, aborted, preempted); then it
goes back to the queue and claims what is cached. Pure bookkeeping: the scheduler decides
when to park and re-queues what ``ready`` returns.

Parked requests are looked at again only when their writer moved, never once per step, so a
burst of thousands of readers costs one check per awaited block per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from services.scheduler.core.request import PREFILL_STATES, Request

QueueEntry = tuple[tuple[int, int], Request]  # (priority key, request): the waiting heap's


def prefix_writers(running: Iterable[Request]) -> dict[int, Request]:
    """Prompt blocks the running prefills will publish and have not yet: hash -> its writer
    (the first in queue order, so the most urgent one)."""
    writers: dict[int, Request] = {}
    for request in running:
        if request.state in PREFILL_STATES:
            add_writer(request, writers)
    return writers


def add_writer(request: Request, writers: dict[int, Request]) -> None:
    for block_hash in request.block_hashes[request.num_published_blocks :]:
        writers.setdefault(block_hash, request)


@dataclass
class _Wait:
    writer: Request
    incarnation: int  # the writer's, when the first reader parked: a preemption bumps it
    block_index: int  # the awaited block's index in the prompt (the same in every reader)
    entries: list[QueueEntry] = field(default_factory=list)

    def over(self) -> bool:
        """The writer published the block (or found it cached) or stopped writing it."""
        w = self.writer
        return (
            w.state not in PREFILL_STATES
            or w.incarnation != self.incarnation
            or w.num_published_blocks > self.block_index
        )


class ParkedReaders:
    def __init__(self) -> None:
        self._waits: dict[int, _Wait] = {}  # awaited block hash -> its writer and readers

    def __bool__(self) -> bool:
        return bool(self._waits)

    def __iter__(self) -> Iterator[Request]:
        for wait in self._waits.values():
            for _, request in wait.entries:
                yield request

    def park(self, entry: QueueEntry, block_hash: int, block_index: int, writer: Request) -> None:
        """Parks a reader on ``block_hash``. Another writer of the same block may already
        be awaited: either one's publication is enough, and if that one stops, ``ready``
        hands its readers back to look again."""
        wait = self._waits.get(block_hash)
        if wait is None:
            wait = self._waits[block_hash] = _Wait(writer, writer.incarnation, block_index)
        wait.entries.append(entry)

    def ready(self) -> list[QueueEntry]:
        """Removes and returns the readers whose wait is over (to be queued again)."""
        done = [h for h, wait in self._waits.items() if wait.over()]
        out: list[QueueEntry] = []
        for block_hash in done:
            out.extend(self._waits.pop(block_hash).entries)
        return out
