"""Bad input never takes a service down: one clear error event each, others keep being served.

Over a real nats-server (public subjects), plus the pure cores (admission backpressure, the
scheduler driver's failure isolation and seq-ordered result application) without NATS.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from messages.api import AbortRequest, ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from messages.internal import AdmittedRequest, SchedulerLoad, ShardAnnounce
from messages.sampling import SamplingParams
from services.admission.core import AdmissionConfig, AdmissionCore
from services.admission.shards import ShardTable, ShardTableConfig
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.launcher import NatsServer
from services.runtime import subjects
from services.scheduler.driver.driver import SchedulerDriver
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner
from tests.helpers import relayed_events, run_on

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]
pytestmark = pytest.mark.usefixtures("torch_single_thread")

CONFIG = SchedulerConfig(max_num_seqs=8, block_size=16, num_blocks=1024)

# (payload, expected code, a word the message must contain)
BAD_GENERATE: list[tuple[bytes, str, str]] = [
    (b'{"prompt": "hi", ', "invalid_request", "JSON"),
    (b"[1, 2, 3]", "invalid_request", "object"),
    (b'{"prompt": 5}', "invalid_request", "prompt"),
    (b'{"prompt_token_ids": ["a", "b"]}', "invalid_request", "prompt_token_ids"),
    (b'{"prompt": "hi", "max_tokens": "many"}', "invalid_request", "max_tokens"),
    (b'{"prompt": "hi", "colour": "blue"}', "invalid_request", "colour"),
    (b'{"prompt": "hi", "prompt_token_ids": [1, 2]}', "invalid_request", "exactly one"),
    (b'{"max_tokens": 4}', "invalid_request", "exactly one"),
    (b'{"prompt": "", "max_tokens": 4}', "invalid_request", "at least one token"),
    (b'{"prompt": "hi", "max_tokens": 0}', "invalid_request", "max_tokens"),
    (b'{"prompt": "hi", "exit_threshold": 2}', "invalid_request", "exit_threshold"),
    (b'{"prompt": "hi", "min_loops": 3, "max_loops": 2}', "invalid_request", "min_loops"),
    (b'{"prompt": "hi", "max_loops": 9}', "invalid_request", "total_ut_steps"),
    (b'{"prompt_token_ids": [1, 512]}', "invalid_request", "vocabulary"),
    (b'{"prompt_token_ids": [-1]}', "invalid_request", "vocabulary"),
    (b'{"prompt_token_ids": [1, 2], "temperature": -1}', "invalid_request", "temperature"),
    (b'{"request_id": "a b", "prompt": "hi"}', "invalid_request", "request_id"),
    (json.dumps({"prompt_token_ids": [7] * 3000}).encode(), "invalid_request", "max_position"),
]


@pytest.mark.services
async def test_bad_requests_get_one_error_each_while_good_client_is_served(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    good = GenerateRequest(
        request_id="good-1",
        prompt_token_ids=[3, 1, 4, 1, 5, 9, 2, 6],
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
    )
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG) as services,
        Client.connect(nats_server.url) as client,
    ):
        good_stream = await client.open(subjects.GENERATE, good)
        first = await good_stream.next()  # the good request is running before the flood
        assert isinstance(first, TokenEvent)
        streams = [await client.open(subjects.GENERATE, payload) for payload, _, _ in BAD_GENERATE]
        bad_aborts = [
            (await client.open(subjects.ABORT, AbortRequest(request_id="nobody")), "not_found"),
            (await client.open(subjects.ABORT, b'{"id": 1}'), "invalid_request"),
        ]
        # a second live request with the same id is refused by the scheduler itself
        dup = await client.open(
            subjects.GENERATE, GenerateRequest(request_id="good-1", prompt_token_ids=[1, 2])
        )

        for stream, (payload, code, word) in zip(streams, BAD_GENERATE, strict=True):
            event = await stream.next(timeout=10)
            assert isinstance(event, ErrorEvent), (payload, event)
            assert event.code == code, (payload, event)
            assert word.lower() in event.message.lower(), (payload, event.message)
        for stream, code in bad_aborts:
            event = await stream.next(timeout=10)
            assert isinstance(event, ErrorEvent) and event.code == code, event
            assert event.message
        dup_event = await dup.next(timeout=10)
        assert isinstance(dup_event, ErrorEvent) and "already live" in dup_event.message
        assert dup_event.request_id == "good-1"

        terminal = check_stream(await good_stream.until_terminal())
        assert isinstance(terminal, FinishedEvent) and len(terminal.token_ids) == 24
        for stream in [*streams, dup, *(s for s, _ in bad_aborts)]:
            await stream.assert_silent(0.05)  # exactly one event each
        assert services["admission"].health()["rejected"] >= len(BAD_GENERATE)
        assert all(s.state == "ready" for s in services.values())
    # the good request's tokens are the engine's
    expected = LLMEngine.from_checkpoint(toy_checkpoint, CONFIG).generate(
        [good.prompt_token_ids], good.sampling_params()
    )
    assert terminal.token_ids == expected[0].token_ids


@pytest.mark.services
async def test_overload_is_refused_with_overloaded(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    config = SchedulerConfig(max_num_seqs=1, block_size=16, num_blocks=1024)
    admission = AdmissionConfig(max_waiting_requests=2)
    async with (
        services_up(nats_server.url, toy_checkpoint, config, admission),
        Client.connect(nats_server.url) as client,
    ):
        reqs = [
            GenerateRequest(
                request_id=f"r{i}",
                prompt_token_ids=[1 + i, 2, 3],
                max_tokens=12,
                temperature=0.0,
                ignore_eos=True,
            )
            for i in range(6)
        ]
        streams = [await client.open(subjects.GENERATE, r) for r in reqs]
        terminals = [check_stream(await s.until_terminal(20)) for s in streams]
    codes = [t.code if isinstance(t, ErrorEvent) else t.finish_reason for t in terminals]
    assert "overloaded" in codes, codes
    assert codes[0] == "length"  # the first one was never refused
    assert set(codes) <= {"overloaded", "length"}


@pytest.mark.services
async def test_a_bug_while_admitting_answers_that_client_by_its_id_and_spares_others(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    """An unexpected exception in admission (a bug) ends that request with one ``internal``
    error event carrying the client's request id; the service goes on serving."""
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG) as services,
        Client.connect(nats_server.url) as client,
    ):
        core = services["admission"].core
        prepare = core.prepare

        def failing_prepare(data: bytes, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            if b"boom" in data:
                raise RuntimeError("injected fault")
            return prepare(data, *args, **kwargs)

        core.prepare = failing_prepare  # type: ignore[method-assign]
        boom = await client.open(
            subjects.GENERATE, GenerateRequest(request_id="boom-1", prompt_token_ids=[1, 2])
        )
        event = await boom.next(timeout=10)
        assert isinstance(event, ErrorEvent) and event.code == "internal", event
        assert event.request_id == "boom-1"
        await boom.assert_silent(0.05)
        good = GenerateRequest(request_id="after", prompt_token_ids=[1, 2, 3], max_tokens=4)
        terminal = check_stream(await client.generate(good))
        assert isinstance(terminal, FinishedEvent) and len(terminal.token_ids) == 4


# ---------------------------------------------------------------------- pure cores
@pytest.mark.unit
def test_admission_backpressure_is_per_shard_and_counts_unacknowledged_sends(
    toy_checkpoint: Path,
) -> None:
    """What ``_route`` refuses with ``overloaded``: a shard's waiting queue as admission
    sees it (its last report plus the sends since) against the per-shard limits."""
    core = AdmissionCore(
        load_model_limits(toy_checkpoint),
        None,
        AdmissionConfig(max_waiting_requests=3, max_waiting_tokens=100),
        admission_id="a1",
    )
    table = ShardTable("a1", block_size=16, config=ShardTableConfig(unseen_expiry_s=10.0))
    table.announce(
        ShardAnnounce(shard_id="0", scheduler_id="s", producer_id="p", block_size=16), 100.0
    )
    table.apply(
        SchedulerLoad(scheduler_id="s", shard_id="0", report_seq=1, time=1000.0), 100.0, 1000.0
    )
    shard = table.shards["0"]

    def why(prompt: int, now: float = 100.0) -> str | None:
        load = table.load(shard, now)
        return core.over_limit(load.num_waiting, load.waiting_tokens, prompt)

    for seq in (1, 2, 3):
        assert why(10) is None
        table.sent("0", seq, 10, 100.0)
    assert "3 requests are waiting" in (why(10) or "")
    # the scheduler has seen two of them and runs one: one waiting + one unseen
    table.apply(
        SchedulerLoad(
            scheduler_id="s",
            shard_id="0",
            report_seq=2,
            time=1000.0,
            num_waiting=1,
            num_waiting_tokens=10,
            last_admission_seq={"a1": 2},
        ),
        100.0,
        1000.0,
    )
    assert why(10) is None
    assert "prompt tokens are waiting" in (why(85) or "")
    # an unacknowledged send is forgotten after a while (it was lost)
    load = table.load(shard, 160.0)
    assert (load.num_waiting, load.waiting_tokens) == (1, 10)


def _driver_and_runner(ckpt: Path, config: SchedulerConfig) -> tuple[SchedulerDriver, ModelRunner]:
    model = OuroModel.from_checkpoint(ckpt)
    driver = SchedulerDriver(config, load_model_limits(ckpt), TextCodec.from_checkpoint(ckpt))
    driver.bind("w1")
    return driver, ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)


_RELAY = subjects.admission_relay("a1")


def _admitted(rid: str, ids: list[int], max_tokens: int) -> AdmittedRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return AdmittedRequest(
        request_id=rid,
        prompt_token_ids=ids,
        params=params,
        reply_subject=f"_INBOX.{rid}",
        relay_subject=_RELAY,
    )


@pytest.mark.unit
def test_scheduler_error_for_one_request_spares_the_others(toy_checkpoint: Path) -> None:
    # atomic prefill, sync: the bad request's rows are in batches of their own
    config = SchedulerConfig(
        block_size=16, num_blocks=256, split_prefill=False, async_scheduling=False
    )
    driver, runner = _driver_and_runner(toy_checkpoint, config)
    out: list = []

    def step() -> None:
        stepped = driver.step()
        assert {r.subject for r in stepped.relays} <= {_RELAY}
        out.extend(relayed_events(stepped))
        for wb in stepped.batches:
            driver.on_result(run_on(runner, wb))

    assert not driver.add(_admitted("good", [5, 6, 7, 8], 8)).relays
    while not any(isinstance(e, TokenEvent) for e in out):
        step()
    real = driver.scheduler.update_from_output

    def broken(batch, result):  # type: ignore[no-untyped-def]
        if any(t.request.request_id == "bad" for t in batch.tasks):
            raise RuntimeError("injected scheduler fault")
        return real(batch, result)

    driver.scheduler.update_from_output = broken  # type: ignore[method-assign]
    driver.add(_admitted("bad", [9, 10, 11], 8))
    while not driver.idle:
        step()
    by_request: dict[str, list] = {}
    for event in out:
        by_request.setdefault(event.request_id, []).append(event)
    bad = check_stream(by_request["bad"])
    assert isinstance(bad, ErrorEvent) and bad.code == "internal"
    assert "injected scheduler fault" in bad.message
    good = check_stream(by_request["good"])
    assert isinstance(good, FinishedEvent)
    expected = LLMEngine.from_checkpoint(toy_checkpoint, config).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert good.token_ids == expected[0].token_ids
    assert driver.scheduler.kv.num_free_blocks == config.num_blocks


@pytest.mark.unit
def test_results_apply_strictly_in_seq_order(toy_checkpoint: Path) -> None:
    config = SchedulerConfig(
        block_size=16,
        num_blocks=256,
        async_scheduling=True,
        max_inflight_batches=2,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=2,
    )
    driver, runner = _driver_and_runner(toy_checkpoint, config)
    driver.add(_admitted("a", list(range(1, 9)), 4))
    events: list = []
    while not driver.idle:
        stepped = driver.step()
        events.extend(relayed_events(stepped))
        results = [run_on(runner, wb) for wb in stepped.batches]
        for result in reversed(results):  # the newer one arrives first
            assert driver.on_result(result)
            if result is not results[0]:
                events.extend(relayed_events(driver.step(schedule=False)))
                assert len(driver.inflight) == len(results)  # held back until its predecessor
        events.extend(relayed_events(driver.step(schedule=False)))
        assert not driver.inflight  # both applied, in order
        if results:
            assert not driver.on_result(results[-1])  # a late duplicate: ignored
    finished = check_stream(events)
    assert isinstance(finished, FinishedEvent) and len(finished.token_ids) == 4


@pytest.mark.services
async def test_nothing_running_is_reported_not_hung(nats_server: NatsServer) -> None:
    async with Client.connect(nats_server.url) as client:
        stream = await client.open(subjects.GENERATE, {"prompt": "hi"})
        with pytest.raises(AssertionError, match="no service answered"):
            await stream.next(timeout=5)
    await asyncio.sleep(0)
