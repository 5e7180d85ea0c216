"""Ordered prefix publication: the producer log, the publisher's framing and the pure index."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixEvent,
    PrefixEventBatch,
    PrefixIndexSnapshot,
    PrefixLookupReply,
    blocks_digest,
)
from services.prefix_cache import PrefixIndex
from services.scheduler.core.kv.prefix_events import PrefixEventLog, new_epoch
from services.scheduler.prefix_publisher import (
    PendingEnvelopes,
    PrefixPublisher,
    message_id,
    split_envelope,
)

pytestmark = pytest.mark.unit


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), num_tokens_per_block=16)


def _removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes))


def _emit(log: PrefixEventLog, *events: PrefixEvent) -> PrefixEventBatch:
    batch = log.emit(list(events))
    assert batch is not None
    return batch


# ------------------------------------------------------------------ producer log
def test_log_assigns_seqs_from_one_per_epoch() -> None:
    log = PrefixEventLog("p")
    first = log.epoch
    assert log.emit([]) is None and log.last_seq == 0
    assert [_emit(log, _stored(i)).event_seq for i in range(3)] == [1, 2, 3]
    rebased = log.rebase([AllBlocksCleared(), _stored(7)])
    assert log.epoch > first and rebased.epoch == log.epoch and rebased.event_seq == 1
    assert rebased.events == [AllBlocksCleared(), _stored(7)]
    assert _emit(log, _stored(8)).event_seq == 2


def test_epochs_are_time_ordered() -> None:
    first = new_epoch()
    assert len(first) == 32 and int(first, 16) >= 0
    assert new_epoch(after=first) > first
    assert new_epoch(after="f" * 31 + "0") == "f" * 31 + "1"  # clock behind: bump it


# ------------------------------------------------------------------ publisher framing
def test_an_oversized_envelope_travels_as_ordered_parts_that_rebuild_it() -> None:
    hashes = [2**63 + i for i in range(5000)]  # real hashes: 9 bytes each in msgpack
    batch = PrefixEventBatch(
        producer_id="p",
        epoch="e",
        event_seq=4,
        events=[AllBlocksCleared(), BlockStored(block_hashes=hashes, num_tokens_per_block=4)],
    )
    parts = split_envelope(batch, max_bytes=4096)
    assert len(parts) > 5
    assert [p.part for p in parts] == list(range(len(parts)))
    assert {(p.event_seq, p.num_parts) for p in parts} == {(4, len(parts))}
    assert all(len(msgspec.msgpack.encode(p)) <= 4096 for p in parts)
    stored = [e for p in parts for e in p.events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hashes
    # the hash chain goes on across pieces
    assert [e.parent_hash for e in stored[1:]] == [e.block_hashes[-1] for e in stored[:-1]]
    index = PrefixIndex()
    for part in parts[:-1]:
        index.apply(part)
        assert index.applied_seq("p") == 3  # envelope 4 is not whole yet
    index.apply(parts[-1])
    assert index.applied_seq("p") == 4 and index.cached_blocks() == {"p": set(hashes)}
    assert split_envelope(PrefixEventBatch(producer_id="p", epoch="e", event_seq=1), 4096) == [
        PrefixEventBatch(producer_id="p", epoch="e", event_seq=1)
    ]


def test_pending_envelopes_coalesce_into_messages_with_stable_ids() -> None:
    log = PrefixEventLog("p", epoch="e")
    pending = PendingEnvelopes(max_message_bytes=400, max_pending_bytes=10_000)
    for i in range(20):
        assert pending.add(_emit(log, _stored(i, i + 100)))
    seen: list[int] = []
    ids = set()
    while (head := pending.head()) is not None:
        parts, body, mid = head
        assert len(body) <= 400 and len(parts) > 1
        assert msgspec.msgpack.decode(body, type=list[PrefixEventBatch]) == parts
        assert head == pending.head()  # a retry sends the same body under the same id
        ids.add(mid)
        seen += [p.event_seq for p in parts]
        pending.pop(len(parts))
    assert seen == list(range(1, 21)) and len(ids) > 1 and pending.bytes == 0
    assert message_id(parts[0], parts[-1]).startswith("p:e:")
    small = PendingEnvelopes(max_message_bytes=400, max_pending_bytes=100)
    assert not small.add(_emit(log, *(_stored(i) for i in range(20))))  # over: caller rebases


class _GatedPublisher(PrefixPublisher):
    """The publisher's loop with its JetStream call replaced by a gate the test opens (the
    race under test is in the loop's bookkeeping, not in NATS)."""

    def __init__(self, log: PrefixEventLog) -> None:
        nc = SimpleNamespace(max_payload=1 << 20)
        super().__init__(
            nc,  # type: ignore[arg-type]
            "p",
            rebase=lambda: log.rebase([_stored(999)]),
            log=structlog.get_logger(),
            max_pending_bytes=2_000,
        )
        self.gate = asyncio.Event()
        self.sent: list[list[PrefixEventBatch]] = []

    async def _publish(self, body: bytes, msg_id: str) -> bool:
        await self.gate.wait()
        self.sent.append(msgspec.msgpack.decode(body, type=list[PrefixEventBatch]))
        return True


async def test_a_rebase_while_a_message_is_in_flight_keeps_the_new_queue() -> None:
    log = PrefixEventLog("p")
    first = log.epoch
    publisher = _GatedPublisher(log)
    loop = asyncio.create_task(publisher.publish_loop())
    try:
        publisher.submit([_emit(log, _stored(1, 2))])
        await asyncio.sleep(0.01)  # the head is in flight, held at the gate
        # meanwhile the queue outgrows its bound: the publisher rebases to a new epoch once
        # (the rest of the old epoch's batches are inside the snapshot, not queued after it)
        publisher.submit([_emit(log, _stored(*range(i * 10, i * 10 + 10))) for i in range(40)])
        assert publisher.num_rebases == 1
        epoch = publisher.pending.head()[0][0].epoch  # type: ignore[index]
        assert epoch == log.epoch > first
        publisher.submit([_emit(log, _stored(5000))])  # the new epoch goes on
        publisher.gate.set()
        assert await publisher.flush(2.0)
        assert not loop.done()  # the loop survived (it used to pop the new queue's entries)
        # the old message went out, then the new epoch from its first envelope on
        assert publisher.sent[0][0].epoch == first
        later = [b for message in publisher.sent[1:] for b in message]
        assert later and all(b.epoch == epoch for b in later)
        assert [b.event_seq for b in later] == list(range(1, len(later) + 1))
    finally:
        loop.cancel()


def test_a_negative_block_hash_is_malformed() -> None:
    """Snapshots pack hashes as 64 unsigned bits: one negative hash applied would make every
    later snapshot fail, so the envelope is refused at decoding (a gap, as any bad message)."""
    raw = {"producer_id": "p", "epoch": "e", "event_seq": 1}
    for kind in ("block_stored", "block_removed"):
        bad = {**raw, "events": [{"kind": kind, "block_hashes": [-5]}]}
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=PrefixEventBatch)
    top = {**raw, "events": [{"kind": "block_stored", "block_hashes": [(1 << 64) - 1]}]}
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(top), type=PrefixEventBatch)
    index = PrefixIndex()
    index.apply(batch)
    assert PrefixIndex.from_snapshot(index.to_snapshot()).num_blocks() == 1


# ------------------------------------------------------------------ index basics
def test_in_order_apply_and_lookup() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e")
    out = index.apply(_emit(log, _stored(1, 2, 3)))
    assert out.applied and not out.gap
    assert index.lookup([1, 2, 9]) == PrefixLookupReply(producer_id="p", num_blocks=2, event_seq=1)
    assert index.lookup([9, 1]) == PrefixLookupReply()
    index.apply(_emit(log, _removed(2)))
    assert index.lookup([1, 2, 3]).num_blocks == 1  # never visible after its removal
    index.apply(_emit(log, AllBlocksCleared()))
    assert index.cached_blocks() == {}


def test_a_gap_the_stream_cannot_fill_drops_the_producer_then_applying_goes_on() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e")
    b1, b2, b3 = _emit(log, _stored(1, 2)), _emit(log, _removed(1)), _emit(log, _stored(3))
    other = PrefixEventBatch(producer_id="q", epoch="e", event_seq=1, events=[_stored(1)])
    index.apply(b1)
    index.apply(other)
    out = index.apply(b3)  # b2 (removing block 1) never arrives
    assert out.gap and out.applied
    # block 1 may be gone, so the index must not claim it for p; 3 was stored after the gap
    assert index.cached_blocks() == {"p": {3}, "q": {1}}
    assert index.lookup([1]).producer_id == "q"
    assert index.apply(b2).duplicate and index.apply(b1).duplicate  # late: ignored
    assert index.cached_blocks()["p"] == {3} and index.num_gaps == 1


def test_new_epoch_drops_old_blocks_and_stale_epoch_is_ignored() -> None:
    index = PrefixIndex()
    old, new = PrefixEventLog("p", epoch="e1"), PrefixEventLog("p", epoch="e2")
    old1, old2 = _emit(old, _stored(1)), _emit(old, _stored(2))
    index.apply(old1)
    out = index.apply(new.announce())
    assert out.new_epoch and index.cached_blocks() == {}
    assert index.apply(old2).stale_epoch  # a late envelope of a dead epoch never wins back
    index.apply(_emit(new, _stored(5)))
    assert index.cached_blocks() == {"p": {5}}
    assert index.epoch("p") == "e2" and index.applied_seq("p") == 2


def test_lookup_picks_longest_single_producer_run_then_lowest_id() -> None:
    index = PrefixIndex()
    for pid, hashes in (("b", [1, 2, 3]), ("a", [1, 2]), ("c", [1, 2, 3]), ("d", [2, 3, 4])):
        index.apply(
            PrefixEventBatch(producer_id=pid, epoch="e", event_seq=1, events=[_stored(*hashes)])
        )
    assert index.lookup([1, 2, 3, 4]) == PrefixLookupReply(
        producer_id="b", num_blocks=3, event_seq=1
    )
    assert index.lookup([1, 2]).producer_id == "a"
    assert index.lookup([2, 3, 4]).producer_id == "d"  # runs are never stitched
    index.drop_producer("b")
    assert index.lookup([1, 2, 3]).producer_id == "c"
    index.forget_all()  # the stream lost messages: nobody's blocks can be vouched for
    assert index.cached_blocks() == {} and index.lookup([1]).num_blocks == 0


def test_a_dropped_producers_backlog_does_not_bring_its_blocks_back() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e1")
    index.apply(_emit(log, _stored(1, 2)))
    backlog = _emit(log, _stored(3))  # published before it died, read after the drop
    index.drop_producer("p")
    assert index.apply(backlog).dropped and index.cached_blocks() == {}
    assert index.lookup([3]).num_blocks == 0
    # ... across a snapshot too (a restarted index replays the stream after it)
    wire = msgspec.msgpack.encode(index.to_snapshot())
    restored = PrefixIndex.from_snapshot(msgspec.msgpack.decode(wire, type=PrefixIndexSnapshot))
    assert restored.apply(backlog).dropped and restored.cached_blocks() == {}
    # it comes back restarted: a new epoch applies
    new = PrefixEventLog("p", epoch="e2")
    assert index.apply(new.announce()).applied
    index.apply(_emit(new, _stored(5)))
    assert index.cached_blocks() == {"p": {5}}
    assert index.apply(_emit(log, _stored(4))).stale_epoch  # the old epoch stays dead


def test_a_producer_dropped_while_only_silent_is_applied_again_once_it_reports() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e")
    index.apply(_emit(log, _stored(1)))
    index.drop_producer("p")
    assert not index.revive("q")  # never dropped: nothing to do
    missed = _emit(log, _stored(2))
    assert index.apply(missed).dropped
    assert index.revive("p")  # its load reports arrive again
    out = index.apply(_emit(log, _stored(3)))
    # what it stored while dropped was not seen: only blocks stored after count
    assert out.applied and out.gap and index.cached_blocks() == {"p": {3}}


def test_snapshot_round_trip_then_the_tail_applies_on_top() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e")
    index.apply(_emit(log, _stored(1, 2**64 - 1, 3)))
    index.apply(PrefixEventBatch(producer_id="q", epoch="f", event_seq=7, events=[_stored(9)]))
    index.stream_seq = 42
    wire = msgspec.msgpack.encode(index.to_snapshot())
    restored = PrefixIndex.from_snapshot(msgspec.msgpack.decode(wire, type=PrefixIndexSnapshot))
    assert restored.stream_seq == 42 and restored.cached_blocks() == index.cached_blocks()
    assert restored.applied_seq("q") == 7 and restored.epoch("p") == "e"
    assert restored.lookup([1, 2**64 - 1]).num_blocks == 2
    tail = _emit(log, _removed(1))
    for idx in (index, restored):
        idx.apply(tail)
    assert restored.cached_blocks() == index.cached_blocks() == {"p": {2**64 - 1, 3}, "q": {9}}
    assert blocks_digest({3, 2**64 - 1}) == blocks_digest([2**64 - 1, 3]) != blocks_digest([3])


# ------------------------------------------------------------------ property
_HASHES = st.integers(0, 11)


@st.composite
def _events(draw: st.DrawFn) -> list[PrefixEvent]:
    out: list[PrefixEvent] = []
    for kind in draw(st.lists(st.sampled_from("sssrrc"), min_size=1, max_size=3)):
        if kind == "s":
            out.append(_stored(*draw(st.lists(_HASHES, min_size=1, max_size=4))))
        elif kind == "r":
            out.append(_removed(*draw(st.lists(_HASHES, min_size=1, max_size=3))))
        else:
            out.append(AllBlocksCleared())
    return out


# one step: (producer, events) or (producer, None) = that producer restarts (a new epoch,
# announced with AllBlocksCleared as a restarted scheduler does)
_SCRIPT = st.lists(
    st.tuples(st.sampled_from(["p0", "p1"]), st.one_of(_events(), st.none())),
    min_size=1,
    max_size=30,
)


def _apply_set(state: set[int], events: list[PrefixEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            state.difference_update(event.block_hashes)
        else:
            state.clear()


@settings(max_examples=200, deadline=None)
@given(script=_SCRIPT, data=st.data())
def test_in_order_stream_with_losses_and_redeliveries_never_gives_a_wrong_hit(
    script: list[tuple[str, list[PrefixEvent] | None]], data: st.DataObject
) -> None:
    """The stream delivers in publish order, but may lose messages (aged out: the reader
    sees the hole in the stream sequence) and re-deliver ones already read. Whatever it
    does, every block the index shows for a producer is one that producer really holds at
    that point; with no loss the index equals the producers' tables exactly."""
    logs = {pid: PrefixEventLog(pid) for pid in ("p0", "p1")}
    truth = {pid: set[int]() for pid in logs}
    sent: list[tuple[PrefixEventBatch, dict[str, frozenset[int]]]] = []
    for pid, events in script:
        if events is None:
            logs[pid] = PrefixEventLog(pid, new_epoch(after=logs[pid].epoch))
            events = [AllBlocksCleared()]
        batch = _emit(logs[pid], *events)
        _apply_set(truth[pid], events)
        sent.append((batch, {p: frozenset(s) for p, s in truth.items()}))

    exact = PrefixIndex()
    for batch, _ in sent:
        exact.apply(batch)
    assert exact.cached_blocks() == {pid: s for pid, s in truth.items() if s}

    lost = data.draw(st.sets(st.integers(0, len(sent) - 1)))
    index = PrefixIndex()
    hole = False
    since_hole = 0  # the first message read after the last hole
    for i, (batch, truth_then) in enumerate(sent):
        if i in lost:
            hole = True
            continue
        if hole:  # the reader sees the hole in the stream sequence (stream.py): whose? unknown
            index.forget_all()
            hole = False
            since_hole = i
        index.apply(batch)
        if data.draw(st.booleans()):
            # a re-delivery of something already read. The reader drops any message at or
            # below the stream position it applied (stream.py); the index must also take a
            # repeat of one it applied since its last forget_all as a no-op
            index.apply(sent[data.draw(st.integers(since_hole, i))][0])
        for pid, held in index.cached_blocks().items():
            assert held <= truth_then[pid], (pid, held, truth_then[pid])
