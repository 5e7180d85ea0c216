"""Client retries by request_id never start a second generation (real nats-server).

- a retry after the request finished gets the same finished event from admission's record;
- a retry while it runs is re-attached to the running stream (token indices never repeat);
- a live id reused from another reply subject is refused;
- the client library retries while no admission is up, then completes;
- the pure pieces: the client's retry state, the finished record.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from services.admission.core import FinishedRecord, OpenRequests, Retry, classify_retry
from services.client import CallState, RetryPolicy, stream_requests
from services.common.config import SchedulerConfig
from services.runtime import subjects
from services.runtime.bus import encode_json

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]
CONFIG = SchedulerConfig(block_size=4, num_blocks=512)


@pytest.mark.services
async def test_retry_after_finish_gets_the_same_event_and_no_rerun(
    nats_server, toy_checkpoint: Path, run_dir: Path
) -> None:
    body = GenerateRequest(request_id="again-1", prompt_token_ids=[5, 6, 7], max_tokens=4)
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG) as services,
        Client.connect(nats_server.url) as client,
    ):
        inbox = client.nc.new_inbox()
        sub = await client.nc.subscribe(inbox)
        await client.nc.publish(subjects.GENERATE, encode_json(body), reply=inbox)
        first = await _until_terminal(sub)
        admitted = services["admission"].num_admitted  # type: ignore[attr-defined]
        await client.nc.publish(subjects.GENERATE, encode_json(body), reply=inbox)
        second = await _until_terminal(sub)
        assert isinstance(first[-1], FinishedEvent) and second == [first[-1]]
        assert services["admission"].num_admitted == admitted  # type: ignore[attr-defined]
        # the same id from another reply subject is not this client's: refused
        other = await client.generate(body)
        assert isinstance(other[-1], ErrorEvent) and "already finished" in other[-1].message


@pytest.mark.services
async def test_retry_while_live_reattaches_without_a_second_generation(
    nats_server, toy_checkpoint: Path, run_dir: Path
) -> None:
    body = GenerateRequest(
        request_id="live-1", prompt_token_ids=[9, 8, 7], max_tokens=200, ignore_eos=True
    )
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG) as services,
        Client.connect(nats_server.url) as client,
    ):
        inbox = client.nc.new_inbox()
        sub = await client.nc.subscribe(inbox)
        await client.nc.publish(subjects.GENERATE, encode_json(body), reply=inbox)
        events = [await _next(sub) for _ in range(3)]
        await client.nc.publish(subjects.GENERATE, encode_json(body), reply=inbox)  # retry
        events += await _until_terminal(sub)
        terminal = check_stream(events)  # indices 0..n-1 once each: one generation
        assert isinstance(terminal, FinishedEvent) and len(terminal.token_ids) == 200
        with pytest.raises(asyncio.TimeoutError):
            await sub.next_msg(timeout=0.3)  # exactly one terminal
        assert services["admission"].num_retries == 1  # type: ignore[attr-defined]


@pytest.mark.services
async def test_client_retries_until_admission_is_up(
    nats_server, toy_checkpoint: Path, run_dir: Path
) -> None:
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=3)
    policy = RetryPolicy(max_attempts=8, backoff_s=0.25)
    run = asyncio.ensure_future(
        stream_requests(nats_server.url, [request], timeout=60, retry=policy)
    )
    await asyncio.sleep(1.0)  # "no responders" while nothing serves rlt.v1.generate
    assert not run.done()
    async with services_up(nats_server.url, toy_checkpoint, CONFIG):
        (result,) = await run
    assert isinstance(result, FinishedEvent) and len(result.token_ids) == 3


async def _next(sub) -> TokenEvent | FinishedEvent | ErrorEvent:  # type: ignore[no-untyped-def]
    from tests.conftest_nats import _DECODER

    return _DECODER.decode((await sub.next_msg(timeout=30)).data)


async def _until_terminal(sub) -> list:  # type: ignore[no-untyped-def]
    events = [await _next(sub)]
    while isinstance(events[-1], TokenEvent):
        events.append(await _next(sub))
    return events


# ------------------------------------------------------------------ pure pieces
@pytest.mark.unit
def test_call_state_retries_on_unavailable_with_backoff_and_passes_each_token_once() -> None:
    call = CallState(RetryPolicy(max_attempts=3, idle_s=10, backoff_s=0.5), now=0.0)
    assert call.due(0.0)
    call.sent(0.0)
    assert not call.due(5.0) and call.due(10.0)  # silence: ask again
    assert not call.unavailable(1.0)  # not final: again after the backoff
    assert not call.due(1.4) and call.due(1.5)
    call.sent(1.5)
    tok = TokenEvent(request_id="r", index=0, token_id=1, exit_depth=0, text="")
    assert call.token(tok) and not call.token(tok)  # a re-run's repeated index is dropped
    call.reconnected(2.0)
    assert call.due(2.0)
    call.sent(2.0)
    assert call.unavailable(3.0) and call.done  # attempts used up: the final answer


@pytest.mark.unit
def test_finished_record_and_retry_classification() -> None:
    record = FinishedRecord(keep_s=10, max_bytes=10)
    table = OpenRequests(scheduler_lost_s=5)
    table.opened(1, "a", "_INBOX.x", "t", now=0.0)
    assert classify_retry("a", "_INBOX.x", table, record, 0.0) == (Retry.REATTACH, None)
    assert classify_retry("a", "_INBOX.y", table, record, 0.0) == (Retry.CONFLICT, None)
    assert table.superseded("a") is not None and table.find("a") is None
    record.add("a", "_INBOX.x", b"12345", now=1.0)
    assert classify_retry("a", "_INBOX.x", table, record, 2.0) == (Retry.REPLAY, b"12345")
    assert classify_retry("b", "_INBOX.x", table, record, 2.0) == (Retry.NEW, None)
    record.add("c", "_INBOX.z", b"123456", now=3.0)  # over 10 bytes: the oldest goes
    assert record.get("a", 3.0) is None and record.get("c", 3.0) is not None
    assert record.get("c", 14.0) is None  # past keep_s
