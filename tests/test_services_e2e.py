"""End to end over a real nats-server: the four services in-process on the toy checkpoint.

Tokens and exit depths over NATS must equal the in-process engine and the serial oracle;
streams arrive in order with one terminal event; aborts free all KV; one request can be
followed through the logs of every service.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from messages.api import AbortRequest, ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.launcher import NatsServer, free_port
from services.oracle import SerialOracle
from services.runtime import subjects
from services.runtime.health import check as health_check
from services.runtime.logging import configure_logging

pytest.register_assert_rewrite("tests.conftest_nats")  # its helpers assert too

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402
from tests.service_cases import as_request  # noqa: E402
from tests.service_procs import start_rlt_up  # noqa: E402

# the shared nats-server / checkpoint fixtures (tests/conftest.py belongs to the lead)
pytest_plugins = ["tests.conftest_nats"]
pytestmark = [pytest.mark.services, pytest.mark.usefixtures("torch_single_thread")]

MAX_TOKENS = 6
CONFIGS = {
    # atomic prefill, sync scheduling (one batch in flight)
    "wcpb-off": SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=512
    ),
    # wavefront chunked prefill with async scheduling (two batches in flight)
    "wcpb-on": SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=4,
        block_size=4,
        num_blocks=512,
        async_scheduling=True,
    ),
}


def _cases() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, 400) for _ in range(n)]

    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return [
        (prompt(7), SamplingParams(**greedy)),  # fixed depth, min_loops 2
        (prompt(11), SamplingParams(**greedy, min_loops=1, exit_threshold=0.7)),
        (prompt(5), SamplingParams(**greedy, min_loops=1, exit_threshold=0.7)),
        (prompt(9), SamplingParams(**greedy, min_loops=1, exit_threshold=1.0)),
        (prompt(13), SamplingParams(**greedy, min_loops=1, max_loops=3, exit_threshold=0.7)),
    ]


async def _one_client(url: str, req: GenerateRequest) -> list:
    # one NATS connection per client: they really are concurrent clients
    async with Client.connect(url) as client:
        return await client.generate(req)


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_pipeline_matches_engine_and_oracle(
    name: str,
    nats_server: NatsServer,
    toy_checkpoint: Path,
    oracle: SerialOracle,
    run_dir: Path,
) -> None:
    config = CONFIGS[name]
    cases = _cases()
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, ignore_eos=True)
    cases.append((cases[0][0], sampled))  # seeded sampling is deterministic too
    text = "The quick brown fox jumps over the lazy dog."

    async with services_up(nats_server.url, toy_checkpoint, config) as services:
        requests = [as_request(f"{name}-{i}", ids, p) for i, (ids, p) in enumerate(cases)]
        text_req = GenerateRequest(
            request_id=f"{name}-text",
            prompt=text,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
        )
        streams = await asyncio.gather(
            *(_one_client(nats_server.url, r) for r in [*requests, text_req])
        )
        scheduler = services["scheduler"].driver.scheduler  # type: ignore[attr-defined]
        assert scheduler.kv.num_free_blocks == config.num_blocks
        # the first batches run on the compute thread; short CPU batches after them on the
        # loop: the equalities below hold for both
        worker = services["worker"]
        inline, batches = worker.queue.num_inline_batches, worker.num_batches  # type: ignore[attr-defined]
        assert 1 <= inline < batches, (inline, batches)

    finished = [check_stream(s) for s in streams]
    assert all(isinstance(f, FinishedEvent) for f in finished), finished
    for f, req in zip(finished, [*requests, text_req], strict=True):
        assert f.request_id == req.request_id
        assert f.finish_reason == "length"

    # the in-process engine, same config
    engine = LLMEngine.from_checkpoint(toy_checkpoint, config)
    tokenizer_ids = services["admission"].core.codec.encode(text)  # type: ignore[attr-defined]
    expected = engine.generate(
        [ids for ids, _ in cases] + [tokenizer_ids],
        [p for _, p in cases] + [cases[0][1]],  # the text request's params equal case 0's
    )
    for got, want in zip(finished, expected, strict=True):
        assert got.token_ids == want.token_ids, got.request_id
        assert got.exit_depths == want.exit_depths, got.request_id
    assert finished[-1].num_prompt_tokens == len(tokenizer_ids)

    # the serial oracle (greedy requests)
    for got, (ids, p) in zip(finished, cases, strict=False):
        if p.temperature != 0.0:
            continue
        ref = oracle.generate(
            ids,
            max_tokens=p.max_tokens,
            min_loops=p.min_loops,
            max_loops=p.max_loops,
            exit_threshold=p.exit_threshold,
            ignore_eos=True,
        )
        assert (got.token_ids, got.exit_depths) == (ref.token_ids, ref.exit_depths)

    # streamed text pieces add up to the finished text
    for events in streams:
        pieces = "".join(e.text for e in events if isinstance(e, TokenEvent))
        assert pieces == events[-1].text


async def test_prefix_hits_over_nats_equal_the_oracle(
    nats_server: NatsServer, toy_checkpoint: Path, oracle: SerialOracle, run_dir: Path
) -> None:
    """A second wave of concurrent clients shares prefixes with the first: the scheduler
    claims cached blocks (num_cached_tokens > 0), prefill starts at the hit, and tokens and
    exit depths still equal the serial oracle."""
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=4,
        block_size=4,
        num_blocks=512,
        async_scheduling=True,
        enable_prefix_caching=True,
    )
    rng = random.Random(11)
    bases = [[rng.randrange(1, 400) for _ in range(n)] for n in (9, 13, 17)]
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
    )
    first = [as_request(f"w1-{i}", b, params) for i, b in enumerate(bases)]
    second = [as_request(f"w2-{i}", [*b, 7, 8, 9], params) for i, b in enumerate(bases)]
    async with services_up(nats_server.url, toy_checkpoint, config):
        waves = []
        for wave in (first, second):
            waves.append(await asyncio.gather(*(_one_client(nats_server.url, r) for r in wave)))
    for wave, requests in zip(waves, (first, second), strict=True):
        for events, req in zip(wave, requests, strict=True):
            got = check_stream(events)
            assert isinstance(got, FinishedEvent), got
            ref = oracle.generate(
                req.prompt_token_ids,
                max_tokens=MAX_TOKENS,
                min_loops=1,
                exit_threshold=0.7,
                ignore_eos=True,
            )
            assert (got.token_ids, got.exit_depths) == (ref.token_ids, ref.exit_depths)
            # the second wave hits every full block the first wave's prompt published
            base = len(req.prompt_token_ids) - (3 if requests is second else 0)
            assert got.num_cached_tokens == (base // 4 * 4 if requests is second else 0)


async def test_abort_mid_stream_frees_kv(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    config = SchedulerConfig(  # room for a long request: it must still be running at abort
        wavefront_chunked_prefill=True,
        prefill_chunk_size=4,
        block_size=16,
        num_blocks=512,
        async_scheduling=True,
    )
    long = GenerateRequest(
        request_id="long-1",
        prompt_token_ids=list(range(1, 30)),
        max_tokens=1500,
        temperature=0.0,
        ignore_eos=True,
    )
    async with (
        services_up(nats_server.url, toy_checkpoint, config) as services,
        Client.connect(nats_server.url) as client,
    ):
        stream = await client.open(subjects.GENERATE, long)
        while len(stream.events) < 3:
            assert isinstance(await stream.next(), TokenEvent)
        abort = await client.open(subjects.ABORT, AbortRequest(request_id="long-1"))
        events = await stream.until_terminal()
        terminal = check_stream(events)
        assert isinstance(terminal, FinishedEvent)
        assert terminal.finish_reason == "abort"
        assert 3 <= len(terminal.token_ids) < 1500
        await stream.assert_silent()
        ack = await abort.next()  # the abort requester hears how it ended
        assert isinstance(ack, FinishedEvent) and ack.finish_reason == "abort"

        driver = services["scheduler"].driver  # type: ignore[attr-defined]
        for _ in range(200):  # the batch in flight at abort time still comes back
            if driver.idle:
                break
            await asyncio.sleep(0.01)
        assert driver.idle
        assert driver.scheduler.kv.num_free_blocks == config.num_blocks
        driver.scheduler.kv.check_consistency()

        # aborting it again: it is gone
        again = await client.open(subjects.ABORT, AbortRequest(request_id="long-1"))
        err = await again.next()
        assert isinstance(err, ErrorEvent) and err.code == "not_found"


async def test_worker_batch_error_becomes_error_events(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    config = CONFIGS["wcpb-off"]
    async with services_up(nats_server.url, toy_checkpoint, config) as services:
        worker = services["worker"]
        runner = worker.runner  # type: ignore[attr-defined]
        real = runner.execute

        def flaky(batch):  # type: ignore[no-untyped-def]
            if any(r.request_id == "boom" for r in batch.rows):
                raise RuntimeError("injected fault")
            return real(batch)

        runner.execute = flaky
        async with Client.connect(nats_server.url) as client:
            bad = await client.generate(
                GenerateRequest(request_id="boom", prompt_token_ids=[5, 6, 7], max_tokens=4)
            )
            terminal = check_stream(bad)
            assert isinstance(terminal, ErrorEvent), bad
            assert terminal.code == "internal" and "injected fault" in terminal.message
            # the pipeline keeps serving
            ok = await client.generate(
                GenerateRequest(
                    request_id="fine",
                    prompt_token_ids=[5, 6, 7],
                    max_tokens=4,
                    temperature=0.0,
                    ignore_eos=True,
                )
            )
            assert isinstance(check_stream(ok), FinishedEvent)
        assert worker.num_failed >= 1  # type: ignore[attr-defined]


async def test_logs_follow_one_request_and_services_are_discoverable(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    buf = io.StringIO()
    configure_logging("info", stream=buf)
    config = SchedulerConfig(block_size=4, num_blocks=256, enable_prefix_caching=True)
    try:
        async with (
            services_up(nats_server.url, toy_checkpoint, config) as services,
            Client.connect(nats_server.url) as client,
        ):
            events = await client.generate(
                GenerateRequest(
                    request_id="traced-1",
                    prompt_token_ids=list(range(1, 21)),
                    max_tokens=3,
                    temperature=0.0,
                )
            )
            assert isinstance(check_stream(events), FinishedEvent)

            # its prompt blocks were published to the prefix cache; the same prompt again
            # is a hit in the scheduler's own KV
            index = services["prefix-cache"].index  # type: ignore[attr-defined]
            for _ in range(100):
                if index.cached_blocks():
                    break
                await asyncio.sleep(0.01)
            again = await client.generate(
                GenerateRequest(prompt_token_ids=list(range(1, 21)), max_tokens=3)
            )
            second = check_stream(again)
            assert isinstance(second, FinishedEvent) and second.num_cached_tokens > 0

            # every service answers micro discovery and its own health subject
            nc = client.nc
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish("$SRV.PING", b"", reply=inbox)
            names = set()
            while len(names) < 4:
                names.add(json.loads((await sub.next_msg(timeout=5)).data)["name"])
            assert names == {"rlt-admission", "rlt-scheduler", "rlt-worker", "rlt-prefix-cache"}
            info = json.loads((await nc.request("$SRV.INFO.rlt-scheduler", b"")).data)
            assert {e["subject"] for e in info["endpoints"]} >= {subjects.sched_submit("0")}
            for name in ("admission", "scheduler", "worker", "prefix-cache"):
                health = json.loads((await nc.request(subjects.health(name), b"")).data)
                assert health["status"] == "ready"
                assert await health_check(name, nats_server.url, 2.0) is None  # compose check
            assert services["worker"].health()["batches"] > 0
    finally:
        configure_logging()

    lines = [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
    mine = [entry for entry in lines if entry.get("request_id") == "traced-1"]
    assert {entry["service"] for entry in mine} == {"admission", "scheduler", "worker"}
    traces = {entry["trace_id"] for entry in mine if "trace_id" in entry}
    assert len(traces) == 1  # one trace id across all services
    assert all("prompt_token_ids" not in entry and "prompt" not in entry for entry in lines)


async def test_client_streams_json_lines(
    nats_server: NatsServer,
    toy_checkpoint: Path,
    run_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``rlt generate --json`` (online): one terminal JSON line per request, in input order."""
    from services.cli import build_parser
    from services.launcher.generate import main_generate_online

    config = CONFIGS["wcpb-off"]
    async with services_up(nats_server.url, toy_checkpoint, config):
        args = build_parser().parse_args(
            [
                "generate",
                "hello world",
                "--prompt-ids",
                "1,2,3",
                "--prompt-ids",
                "512",
                "--max-tokens",
                "3",
                "--json",
                "--nats-url",
                nats_server.url,
            ]
        )
        # the client runs its own event loop: give it a thread
        rc = await asyncio.to_thread(main_generate_online, args)
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["type"] for e in out] == ["finished", "finished", "error"]
    assert out[1]["num_prompt_tokens"] == 3 and len(out[1]["token_ids"]) == 3
    assert out[2]["code"] == "invalid_request"
    assert rc == 1  # one request errored


def test_rlt_up_serves_then_stops_cleanly_on_sigint(tmp_path: Path, toy_checkpoint: Path) -> None:
    """The real commands: ``rlt up`` (own nats-server + 4 services), ``rlt generate`` against
    it, then Ctrl-C: everything drains and exits 0, and the nats-server is gone.

    Secure by default: NATS refuses a connection without credentials; the client URL (the
    client user's credentials) is in a file only this OS user can read, which ``rlt
    generate`` finds by itself; that user can neither read ``>`` nor publish into the
    services' subjects; and the file is gone when ``rlt up`` exits."""
    port = free_port()
    url_file = tmp_path / "secrets" / "client-url"
    env = {
        **os.environ,
        "RLT_RUN_DIR": str(tmp_path),
        "RLT_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": "1",
        "RLT_CLIENT_URL_FILE": str(url_file),
    }
    env.pop("RLT_NATS_URL", None)
    cli = [sys.executable, "-m", "services.cli"]
    http = ["--http-port", str(free_port())]
    log = tmp_path / "rlt-up.log"
    cmd = [*cli, "up", "--port", str(port), *http, "--checkpoint", str(toy_checkpoint)]
    up, banner = start_rlt_up(cmd, env, log, timeout_s=60)
    try:
        assert url_file.stat().st_mode & 0o777 == 0o600
        client_url = url_file.read_text().strip()
        assert client_url.startswith("nats://client:") and "@127.0.0.1:" in client_url
        assert client_url.split("@")[0].split(":")[-1] not in banner  # no password printed
        asyncio.run(_client_is_fenced_in(f"nats://127.0.0.1:{port}", client_url))
        gen = subprocess.run(  # no --nats-url: the client URL file
            [*cli, "generate", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos",
             "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr
        (line,) = gen.stdout.splitlines()
        event = json.loads(line)
        assert event["type"] == "finished" and len(event["token_ids"]) == 3
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0, log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    assert not url_file.exists()


async def _client_is_fenced_in(plain_url: str, client_url: str) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(plain_url, allow_reconnect=False)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(client_url, allow_reconnect=False, error_cb=on_error)
    try:
        await nc.subscribe(">")
        # internal subjects, another client's inbox, a JetStream stream capturing inboxes
        forged = ("rlt.v1.worker.batch.x", "rlt.v1.sched.submit", "_INBOX.victim",
                  "$JS.API.STREAM.CREATE.EVIL")  # fmt: skip
        for subject in forged:
            await nc.publish(subject, b"forged")
        await nc.flush()
        for _ in range(100):
            if len(errors) >= 5:
                break
            await asyncio.sleep(0.02)
        assert any('subscription to ">"' in e for e in errors), errors
        for subject in (s.lower() for s in forged):
            assert any(f'publish to "{subject}"' in e for e in errors), (subject, errors)
    finally:
        await nc.close()


async def test_text_prompts_give_the_same_ids_and_text_offline_and_over_nats(
    nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    """One tokenizer path and one detokenizer: `rlt generate --offline` and the services
    turn the same text into the same tokens and the same text (multi-byte characters
    included), and the stream adds up to the final text."""
    prompts = ["The quick brown fox", "naïve café, 東京 — ünïcödé ✓", "Hello!\n  spaces\ttab"]
    params = ["--max-tokens", "12", "--temperature", "1.0", "--seed", "7", "--ignore-eos"]
    offline = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--offline", "--json"]
        + ["--checkpoint", str(toy_checkpoint), *params]
        + [arg for p in prompts for arg in ("--prompt", p)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    expected = [json.loads(line) for line in offline.stdout.splitlines()]
    assert len(expected) == len(prompts)
    config = SchedulerConfig(block_size=4, num_blocks=256)
    async with (
        services_up(nats_server.url, toy_checkpoint, config),
        Client.connect(nats_server.url) as client,
    ):
        for prompt, want in zip(prompts, expected, strict=True):
            events = await client.generate(
                {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 7,
                 "ignore_eos": True}
            )  # fmt: skip
            got = check_stream(events)  # also: the token texts add up to the final text
            assert isinstance(got, FinishedEvent)
            assert got.num_prompt_tokens == want["num_prompt_tokens"]
            assert got.token_ids == want["token_ids"]
            assert got.text == want["text"]
