"""The soak attacker's expectations (``scripts/soak_adversary.py``): what each probe may be
answered, so that a wrong answer is a finding and a right one never is."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from messages.api import ErrorEvent, FinishedEvent
from scripts.soak_adversary import abort_answers

pytestmark = pytest.mark.unit


def _collector(events: dict[int, list[Any]]) -> Any:
    """The one thing ``abort_answers`` reads of a ``StreamCollector``."""
    return SimpleNamespace(terminals=lambda i: events.get(i, []))


def test_an_abort_of_an_honest_id_is_not_found_unless_its_own_squat_may_still_run() -> None:
    finished = FinishedEvent(
        request_id="soak-0-1-7", finish_reason="length", token_ids=[3], exit_depths=[4],
        num_prompt_tokens=1,
    )  # fmt: skip
    refused = ErrorEvent(request_id="soak-0-1-8", code="invalid_request", message="taken")
    col = _collector({5: [], 6: [finished], 9: [refused]})
    squats = {"soak-0-1-7": 5, "soak-0-1-8": 9}
    # never squatted: ids are per tenant, the honest request is out of its reach
    assert abort_answers("soak-0-2-3", squats, col) == ("error:not_found",)
    # its own squat with that id has not ended: the abort may end it (a finished ack)
    assert set(abort_answers("soak-0-1-7", squats, col)) == {"error:not_found", "finished"}
    # ... and once it ended, there is nothing of its own left to abort
    col = _collector({5: [finished]})
    assert abort_answers("soak-0-1-7", squats, col) == ("error:not_found",)
    col = _collector({9: [refused]})
    assert abort_answers("soak-0-1-8", squats, col) == ("error:not_found",)
