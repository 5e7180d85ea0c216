"""The decode worker's unconfirmed pull results: each is published at once and again with
backoff until its scheduler acknowledges it; bounded in number and in age."""

from __future__ import annotations

import itertools

import pytest

from messages.kv_transfer import KVPullResult
from services.worker.kv_transfer.result_outbox import ResultOutbox

pytestmark = pytest.mark.unit


def _result(tid: str, ok: bool = True) -> KVPullResult:
    return KVPullResult(transfer_id=tid, request_id=tid.split("#")[0], ok=ok)


def _ids(due: dict[str, list[KVPullResult]]) -> dict[str, list[str]]:
    return {epoch: [r.transfer_id for r in rs] for epoch, rs in due.items()}


def test_published_at_once_then_with_doubling_backoff_until_acknowledged() -> None:
    box = ResultOutbox(first_retry_s=0.25, max_retry_s=1.0, give_up_s=60.0)
    box.add("e.1", _result("a#1.1"), now=10.0)
    assert box.wait_s(10.0) == 0.0
    assert _ids(box.due(10.0)) == {"e.1": ["a#1.1"]}
    sent_at = [10.0]
    t = 10.0
    while t < 14.0:  # never acknowledged: sent again at +0.25, +0.5, +1, +1 ...
        t += 0.05
        if box.due(t):
            sent_at.append(round(t, 2))
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(sent_at)]
    assert gaps[:4] == [0.25, 0.5, 1.0, 1.0]
    assert box.num_resent == len(sent_at) - 1 > 0
    assert box.confirm(["a#1.1"]) == 1
    assert box.due(100.0) == {} and box.wait_s(100.0) is None and len(box) == 0
    assert box.confirm(["a#1.1"]) == 0  # a second ack of it: nothing open


def test_results_of_several_epochs_go_to_their_own_epoch() -> None:
    box = ResultOutbox()
    box.add("e.1", _result("a#1.1"), 0.0)
    box.add("e.2", _result("b#1.2", ok=False), 0.0)
    box.add("e.1", _result("c#1.3"), 0.0)
    assert _ids(box.due(0.0)) == {"e.1": ["a#1.1", "c#1.3"], "e.2": ["b#1.2"]}
    box.confirm(["a#1.1", "b#1.2"])
    assert _ids(box.due(5.0)) == {"e.1": ["c#1.3"]}


def test_bounded_by_number_and_by_age() -> None:
    box = ResultOutbox(max_entries=3, give_up_s=10.0)
    for i in range(5):
        box.add("e.1", _result(f"r{i}#1.{i}"), float(i))
    assert len(box) == 3 and box.num_dropped == 2  # the oldest two
    assert _ids(box.due(4.0)) == {"e.1": ["r2#1.2", "r3#1.3", "r4#1.4"]}
    assert _ids(box.due(12.5)) == {"e.1": ["r3#1.3", "r4#1.4"]}  # r2: 10.5 s unconfirmed
    assert box.num_given_up == 1
    assert box.due(20.0) == {} and len(box) == 0 and box.num_given_up == 3


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="first_retry_s"):
        ResultOutbox(first_retry_s=2.0, max_retry_s=1.0)
