"""Ordered prefix publication: the producer log and the pure prefix index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixEvent,
    PrefixEventBatch,
    PrefixLookupReply,
    ReplayRequest,
)
from services.prefix_cache import PrefixIndex
from services.scheduler.prefix_events import PrefixEventLog, ReplayUnavailable, new_epoch


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), num_tokens_per_block=16)


def _removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes))


def _emit(log: PrefixEventLog, *events: PrefixEvent) -> PrefixEventBatch:
    batch = log.emit(list(events))
    assert batch is not None
    return batch


# ------------------------------------------------------------------ producer log
def test_log_assigns_seqs_and_replays() -> None:
    log = PrefixEventLog("p", epoch="e", capacity=3)
    assert log.emit([]) is None and log.last_seq == 0
    batches = [_emit(log, _stored(i)) for i in range(5)]
    assert [b.event_seq for b in batches] == [1, 2, 3, 4, 5]
    assert log.latest() == batches[-1]
    assert log.replay(3) == batches[2:]
    assert log.replay(6) == []
    with pytest.raises(ReplayUnavailable):
        log.replay(2)  # fell out of the bounded log


def test_log_answers_overflow_with_a_rebased_snapshot() -> None:
    log = PrefixEventLog("p", capacity=2)
    old_epoch = log.epoch
    for i in range(4):
        _emit(log, _stored(i))
    snapshot: list[PrefixEvent] = [AllBlocksCleared(), _stored(7)]
    assert log.answer(ReplayRequest(producer_id="p", epoch=old_epoch, from_seq=3), list) != []
    (rebased,) = log.answer(
        ReplayRequest(producer_id="p", epoch=old_epoch, from_seq=1), lambda: snapshot
    )
    assert log.epoch != old_epoch and rebased.epoch == log.epoch and rebased.event_seq == 1
    assert rebased.events == [AllBlocksCleared(), _stored(7)]
    # a request about the epoch the log just left is stale
    assert log.answer(ReplayRequest(producer_id="p", epoch=old_epoch, from_seq=1), list) == []


# ------------------------------------------------------------------ index basics
def test_in_order_apply_and_lookup() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e")
    out = index.apply(_emit(log, _stored(1, 2, 3)))
    assert out.applied_seqs == [1] and out.replay is None
    assert index.lookup([1, 2, 9]) == PrefixLookupReply(producer_id="p", num_blocks=2, event_seq=1)
    assert index.lookup([9, 1]) == PrefixLookupReply()
    index.apply(_emit(log, _removed(2)))
    assert index.lookup([1, 2, 3]).num_blocks == 1  # never visible after its removal
    index.apply(_emit(log, AllBlocksCleared()))
    assert index.snapshot() == {}


def test_gap_buffers_and_asks_for_replay_then_duplicates_are_ignored() -> None:
    index, log = PrefixIndex(), PrefixEventLog("p", epoch="e")
    b1, b2, b3 = (_emit(log, _stored(i)) for i in (1, 2, 3))
    out = index.apply(b3)
    assert out.applied_seqs == []
    assert out.replay == ReplayRequest(producer_id="p", epoch="e", from_seq=1)
    assert index.snapshot() == {}  # nothing out of order becomes visible
    assert index.apply(b3).duplicate  # re-sent while stuck: re-asks for the gap
    assert index.pending_replays() == [ReplayRequest(producer_id="p", epoch="e", from_seq=1)]
    assert index.apply(b1).applied_seqs == [1]
    assert index.apply(b2).applied_seqs == [2, 3]
    assert index.pending_replays() == []
    assert index.apply(b1).duplicate and index.apply(b3).duplicate
    assert index.snapshot() == {"p": {1, 2, 3}}


def test_epochs_are_time_ordered() -> None:
    first = new_epoch()
    assert len(first) == 32 and int(first, 16) >= 0
    assert new_epoch(after=first) > first
    assert new_epoch(after="f" * 31 + "0") == "f" * 31 + "1"  # clock behind: bump it
    log = PrefixEventLog("p")
    before = log.epoch
    log.rebase([])
    assert log.epoch > before


def test_new_epoch_drops_old_blocks_and_stale_epoch_is_ignored() -> None:
    index = PrefixIndex()
    old, new = PrefixEventLog("p", epoch="e1"), PrefixEventLog("p", epoch="e2")
    old1, old2 = _emit(old, _stored(1)), _emit(old, _stored(2))
    index.apply(old1)
    new1 = _emit(new, _stored(5))
    new2 = _emit(new, _stored(6))
    out = index.apply(new2)  # a new epoch drops everything first, even before its seq 1
    assert out.new_epoch and out.replay == ReplayRequest(producer_id="p", epoch="e2", from_seq=1)
    assert index.snapshot() == {}
    assert index.apply(old2).stale_epoch  # a late envelope of a dead epoch never wins back
    assert index.apply(new1).applied_seqs == [1, 2]
    assert index.snapshot() == {"p": {5, 6}}
    assert index.epoch("p") == "e2" and index.applied_seq("p") == 2


def test_an_older_epoch_seen_first_after_a_newer_one_is_stale() -> None:
    index = PrefixIndex()
    old, new = PrefixEventLog("p", epoch="e1"), PrefixEventLog("p", epoch="e2")
    index.apply(new.announce())
    index.apply(_emit(new, _stored(3)))
    assert index.apply(_emit(old, _stored(1))).stale_epoch
    assert index.snapshot() == {"p": {3}}


def test_announce_drops_the_previous_epoch_before_anything_is_cached() -> None:
    index = PrefixIndex()
    old = PrefixEventLog("p", epoch="e1")
    index.apply(_emit(old, _stored(1)))
    restarted = PrefixEventLog("p", epoch="e2")
    assert index.apply(restarted.announce()).new_epoch
    assert index.snapshot() == {}


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
    # runs are never stitched across producers
    assert index.lookup([2, 3, 4]).producer_id == "d"
    index.drop_producer("b")
    assert index.lookup([1, 2, 3]).producer_id == "c"


def test_buffer_is_bounded_and_replay_refills_it() -> None:
    index, log = PrefixIndex(max_buffered=2), PrefixEventLog("p", epoch="e")
    batches = [_emit(log, _stored(i)) for i in range(1, 6)]
    for b in batches[1:]:
        index.apply(b)
    for b in log.replay(1):
        index.apply(b)
    assert index.snapshot() == {"p": {1, 2, 3, 4, 5}}


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


@settings(max_examples=150, deadline=None)
@given(script=_SCRIPT, capacity=st.sampled_from([2, 1000]), data=st.data())
def test_any_delivery_converges_to_in_order_state(
    script: list[tuple[str, list[PrefixEvent] | None]], capacity: int, data: st.DataObject
) -> None:
    logs = {pid: PrefixEventLog(pid, capacity=capacity) for pid in ("p0", "p1")}
    current = {pid: set[int]() for pid in logs}
    # state after (epoch, seq) per producer: what the index may show at that point
    states: dict[tuple[str, str, int], frozenset[int]] = {}
    sent: list[PrefixEventBatch] = []
    for pid, events in script:
        if events is None:
            logs[pid] = PrefixEventLog(pid, new_epoch(after=logs[pid].epoch), capacity)
            events = [AllBlocksCleared()]
        batch = _emit(logs[pid], *events)
        _apply_set(current[pid], events)
        states[(pid, batch.epoch, batch.event_seq)] = frozenset(current[pid])
        sent.append(batch)

    ordered = PrefixIndex()
    for batch in sent:
        ordered.apply(batch)
    expected = {pid: s for pid, s in current.items() if s}
    assert ordered.snapshot() == expected

    index = PrefixIndex()

    def deliver(batch: PrefixEventBatch) -> list[ReplayRequest]:
        out = index.apply(batch)
        for pid in logs:  # nothing out of order or removed is ever visible
            epoch, seq = index.epoch(pid), index.applied_seq(pid)
            want = states.get((pid, epoch or "", seq), frozenset())
            assert index.snapshot().get(pid, set()) == want
        return [out.replay] if out.replay else []

    # shuffled, duplicated, and with gaps
    stream = data.draw(
        st.permutations(sent + data.draw(st.lists(st.sampled_from(sent))) if sent else [])
    )
    dropped = data.draw(st.sets(st.integers(0, max(len(stream) - 1, 0))))
    requests: list[ReplayRequest] = []
    for i, batch in enumerate(stream):
        if i not in dropped:
            requests += deliver(batch)

    def answer(request: ReplayRequest) -> None:
        log = logs[request.producer_id]

        def snapshot() -> list[PrefixEvent]:
            events: list[PrefixEvent] = [_stored(*sorted(current[request.producer_id]))]
            return events

        before = log.epoch
        for batch in log.answer(request, snapshot):
            if batch.epoch != before:  # a rebase: its seq 1 is the producer's current state
                states[(request.producer_id, batch.epoch, 1)] = frozenset(
                    current[request.producer_id]
                )
            requests.extend(deliver(batch))

    for _ in range(20):  # recovery: replays + periodic re-publication of each log's tail
        while requests:
            answer(requests.pop(0))
        for log in logs.values():
            if (latest := log.latest()) is not None:
                requests += deliver(latest)
        requests += index.pending_replays()
        if not requests:
            break
    assert index.snapshot() == expected
    for query in ([0, 1, 2], [3, 4], list(range(12))):
        assert index.lookup(query).num_blocks == ordered.lookup(query).num_blocks
