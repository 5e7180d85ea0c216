"""Clients that misbehave, and the limits of the bus (services in-process, real nats-server).

- a client that vanishes mid-stream (closes its connection, or unsubscribes): nats-server
  answers the next stream event's reply subject with "no responders", the scheduler aborts
  the request and its KV is freed;
- a client that stops reading its socket slows nobody else;
- a request that outlives RLT_MAX_REQUEST_S ends with ``timeout``;
- limits: max prompt length, NATS max_payload (requests refused up front with a clear error,
  batches over max_payload split in parts, a client message over it refused by NATS itself),
  reply subjects that point into the system are dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from pathlib import Path

import nats
import pytest

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from services.admission import validation as admission_validation
from services.admission.core import AdmissionConfig
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.launcher import NatsServer, free_port
from services.runtime import subjects
from services.scheduler.output_publisher import OutputPublisher

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402
from tests.service_procs import StreamCollector, wait_for  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]
pytestmark = [pytest.mark.services, pytest.mark.usefixtures("torch_single_thread")]

# KV for four 700-token prompts at once (4 x 44 blocks x 4 planes): the max_payload test
# needs them admitted together, which watermark admission only does when their prompts fit
CONFIG = SchedulerConfig(max_num_seqs=8, block_size=16, num_blocks=768)


def _reclaimed(services) -> bool:  # type: ignore[no-untyped-def]
    s = services["scheduler"].driver.scheduler
    return not s.requests and s.kv.num_free_blocks == CONFIG.num_blocks


def _long(rid: str, max_tokens: int = 1500) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt_token_ids=[3, 4, 5, 6], max_tokens=max_tokens, ignore_eos=True
    )


async def test_vanished_client_is_noticed_and_its_request_aborted(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    async with services_up(nats_server.url, toy_checkpoint, CONFIG) as services:
        sched = services["scheduler"]
        # admission relays the stream, so it is the one that notices the client is gone
        admission = services["admission"]
        # 1. the client's process dies: its connection closes with the subscription
        nc = await nats.connect(nats_server.url)
        stream = await Client(nc).open(subjects.GENERATE, _long("gone-1"))
        while len(stream.events) < 3:
            assert isinstance(await stream.next(), TokenEvent)
        await nc.close()
        await wait_for(lambda: _reclaimed(services), 10, "the abandoned request aborted")
        assert admission.health()["clients_gone"] == 1

        # 2. the client stays connected but drops the stream (unsubscribes)
        async with Client.connect(nats_server.url) as client:
            stream = await client.open(subjects.GENERATE, _long("gone-2"))
            await stream.next()
            await stream.sub.unsubscribe()
            await wait_for(lambda: _reclaimed(services), 10, "the dropped stream aborted")
            assert admission.health()["clients_gone"] == 2
            # others are unaffected
            ok = await client.generate(_long("stays", max_tokens=5))
            assert isinstance(check_stream(ok), FinishedEvent)
        sched.driver.scheduler.kv.check_consistency()


async def test_stalled_client_does_not_slow_others(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    async with services_up(nats_server.url, toy_checkpoint, CONFIG) as services:

        async def others() -> float:
            async with Client.connect(nats_server.url) as client:
                t0 = time.monotonic()
                streams = await asyncio.gather(
                    *(client.generate(_long(f"o-{time.monotonic()}-{i}", 40)) for i in range(4))
                )
                for events in streams:
                    assert isinstance(check_stream(events), FinishedEvent)
                return time.monotonic() - t0

        baseline = await others()
        # a raw client that subscribes, asks for a long stream and never reads its socket
        host, port = nats_server.url.removeprefix("nats://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps(
            {
                "request_id": "stalled",
                "prompt_token_ids": [1, 2],
                "max_tokens": 600,
                "ignore_eos": True,
            }
        ).encode()
        stalled.sendall(
            b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true}\r\n'
            b"SUB _INBOX.stalled 1\r\n"
            + f"PUB {subjects.GENERATE} _INBOX.stalled {len(body)}\r\n".encode()
            + body
            + b"\r\n"
        )
        try:
            await wait_for(lambda: "stalled" in services["scheduler"].driver.streams, 10, "stall")
            with_stall = await others()
            # the stalled stream itself still ends and frees its KV (nats-server buffers or
            # drops what the client does not read; the scheduler never waits for it)
            await wait_for(lambda: _reclaimed(services), 60, "the stalled request ended")
        finally:
            stalled.close()
        print(f"\nothers: {baseline:.2f}s alone, {with_stall:.2f}s beside a stalled client")
        assert with_stall < 3 * baseline + 1.0


async def test_request_lifetime_deadline(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG) as services,
        Client.connect(nats_server.url) as client,
    ):
        sched = services["scheduler"]
        sched.options = dataclasses.replace(sched.options, max_request_s=0.5)
        events = await client.generate(_long("forever", 2000 - 4), timeout=20)
        terminal = check_stream(events)
        assert isinstance(terminal, ErrorEvent) and terminal.code == "timeout", terminal
        await wait_for(lambda: _reclaimed(services), 10, "KV freed")


async def test_lifetime_deadline_is_kept_by_admission_when_the_scheduler_does_not(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    """The scheduler's own ``timeout`` counts from a little later than admission's clock;
    when it has not come scheduler_lost_s past admission's deadline, admission ends the
    request itself (and aborts it at its shard), never leaving the client in silence."""
    admission_config = AdmissionConfig(max_request_s=0.5, scheduler_lost_s=1.0)
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG, admission_config) as services,
        Client.connect(nats_server.url) as client,
    ):
        await services["worker"].stop()  # it waits for a worker: it would never end
        started = time.monotonic()
        stream = await client.open(subjects.GENERATE, _long("deadline"))
        terminal = check_stream(await stream.until_terminal(timeout=20))
        assert isinstance(terminal, ErrorEvent) and terminal.code == "timeout", terminal
        assert "RLT_MAX_REQUEST_S" in terminal.message
        assert 1.4 < time.monotonic() - started < 10
        await stream.assert_silent(0.5)
        assert len(services["admission"].open) == 0
        await wait_for(lambda: _reclaimed(services), 10, "aborted at its shard")


async def test_admission_stopping_ends_what_it_relays_once_and_aborts_it(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    """A graceful stop of admission (SIGTERM) waits for the streams it relays; what is
    still open at the deadline ends with one ``unavailable`` (no other admission can take
    over its relay subject) and is aborted at its shard, and new requests are refused."""
    async with (
        services_up(nats_server.url, toy_checkpoint, CONFIG) as services,
        Client.connect(nats_server.url) as client,
    ):
        admission = services["admission"]
        await services["worker"].stop()  # the request waits for a worker meanwhile
        stream = await client.open(subjects.GENERATE, _long("open-at-stop"))
        sched = services["scheduler"].driver
        await wait_for(lambda: "open-at-stop" in sched.streams, 10, "the request queued")
        stopping = asyncio.create_task(admission.stop(drain_timeout=0.5))
        await wait_for(lambda: admission.draining, 5, "admission draining")
        refused = await client.generate(_long("late", max_tokens=3), timeout=10)
        assert isinstance(refused[-1], ErrorEvent) and refused[-1].code == "unavailable"
        terminal = check_stream(await stream.until_terminal(timeout=10))
        assert isinstance(terminal, ErrorEvent) and terminal.code == "unavailable"
        assert "admission shut down" in terminal.message
        await stopping
        await stream.assert_silent(0.3)
        await wait_for(lambda: _reclaimed(services), 10, "aborted at its shard")


async def test_limits_prompt_length_max_payload_and_reply_subjects(
    toy_checkpoint: Path, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 8192\n")  # tiny, so the limits are reachable on the toy
    admission = AdmissionConfig(max_prompt_tokens=1000)
    # atomic prefill with a budget that takes every waiting prompt: five 700-token prompts
    # waiting together share a batch, well over max_payload
    config = dataclasses.replace(CONFIG, split_prefill=False, max_num_batched_tokens=8192)
    with NatsServer(port=free_port(), config_file=conf) as server:
        async with (
            services_up(server.url, toy_checkpoint, config, admission) as services,
            Client.connect(server.url) as client,
        ):
            assert client.nc.max_payload == 8192

            async def error_of(payload: dict) -> ErrorEvent:  # type: ignore[type-arg]
                (event,) = await client.generate(payload, timeout=10)
                assert isinstance(event, ErrorEvent), event
                return event

            # prompt cap (RLT_MAX_PROMPT_TOKENS)
            err = await error_of({"prompt_token_ids": [1] * 1001})
            assert err.code == "invalid_request" and "RLT_MAX_PROMPT_TOKENS" in err.message
            # a prompt whose internal messages would not fit the bus: refused up front
            err = await error_of({"prompt_token_ids": [1] * 900, "max_tokens": 4})
            assert err.code == "invalid_request" and "max_payload" in err.message
            # a finished event that could not fit: refused up front, never a timeout
            err = await error_of({"prompt_token_ids": [1, 2], "max_tokens": 600})
            assert err.code == "invalid_request" and "max_payload" in err.message
            # prompt log-probabilities that could not fit the first token event: refused
            err = await error_of({"prompt_token_ids": [1] * 60, "prompt_logprobs": 20})
            assert err.code == "invalid_request" and "prompt_logprobs" in err.message
            # ... while a few fit, with the first token
            events = await client.generate(
                {"prompt_token_ids": [1, 2, 3], "prompt_logprobs": 1, "max_tokens": 2},
                timeout=10,
            )
            assert isinstance(events[-1], FinishedEvent)
            assert [e.token_id for e in events[0].prompt_logprobs] == [1, 2, 3]
            # should the estimate be short, the scheduler measures the event as the client
            # gets it, and ends the request with a clear error rather than lose its token 0
            monkeypatch.setattr(admission_validation, "_PROMPT_ALTERNATIVE_BYTES", 0)
            too_big = {"prompt_token_ids": [(5 * i) % 400 + 1 for i in range(40)],
                       "prompt_logprobs": 20, "max_tokens": 3}  # fmt: skip
            err = await error_of(too_big)
            assert err.code == "internal" and "max_payload" in err.message, err
            assert "prompt_logprobs" in err.message
            await wait_for(lambda: _reclaimed(services), 10, "the request ended at its shard")
            # and admission would too, were the scheduler to send it (an event that fits as
            # msgpack, the scheduler's form, but not as JSON, the client's)
            monkeypatch.setattr(OutputPublisher, "_fits_client", lambda _self, item, _failed: item)
            too_big["prompt_token_ids"] = too_big["prompt_token_ids"][:9]
            (*_, err) = await client.generate(too_big, timeout=10)
            assert isinstance(err, ErrorEvent) and "max_payload" in err.message, err
            assert "lower" not in err.message  # admission's words, not the scheduler's
            await wait_for(lambda: _reclaimed(services), 10, "aborted at its shard")

            # a client message over max_payload is refused by NATS itself, at the client
            with pytest.raises(nats.errors.MaxPayloadError):
                await client.nc.publish(subjects.GENERATE, b"x" * 9000, reply="_INBOX.big")

            # batches over max_payload travel in parts: 5 new 700-token prompts at once. The
            # scheduler holds off until all five wait, so they share a batch however fast a
            # pass is (one 700-token prompt alone fits the bus)
            prompts = [[(7 * i + j) % 500 + 1 for j in range(700)] for i in range(5)]
            sched = services["scheduler"]
            bind_worker = sched._bind_worker  # type: ignore[attr-defined]
            held = [True]
            monkeypatch.setattr(sched, "_bind_worker", lambda: not held[0] and bind_worker())
            col = await StreamCollector(client.nc).start()
            for i, ids in enumerate(prompts):
                await col.send(
                    i,
                    {
                        "prompt_token_ids": ids,
                        "max_tokens": 4,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    },
                )
            waiting = sched.driver.scheduler.num_waiting  # type: ignore[attr-defined]
            await wait_for(lambda: waiting() == 5, 10, "all five prompts waiting")
            held[0] = False
            sched._wake.set()  # type: ignore[attr-defined]
            await col.wait_done(range(5), 60)  # type: ignore[arg-type]
            expected = LLMEngine.from_checkpoint(toy_checkpoint, config).generate(
                prompts,
                GenerateRequest(max_tokens=4, temperature=0.0, ignore_eos=True).sampling_params(),
            )
            for i, want in enumerate(expected):
                got = check_stream(col.events[i])
                assert isinstance(got, FinishedEvent), got
                assert got.token_ids == want.token_ids
            assert services["worker"]._batches_in.joined >= 1  # type: ignore[attr-defined]

            # a reply subject pointing into the system is never published to
            spy = await client.nc.subscribe("rlt.v1.worker.>")
            await client.nc.publish(
                subjects.GENERATE, b'{"prompt":"hi"}', reply="rlt.v1.worker.batch.x"
            )
            await client.nc.flush()
            with pytest.raises(nats.errors.TimeoutError):
                while True:  # heartbeats are fine; anything on the batch subject is not
                    msg = await spy.next_msg(timeout=0.5)
                    assert not msg.subject.startswith("rlt.v1.worker.batch.x"), msg
            assert _reclaimed(services)
