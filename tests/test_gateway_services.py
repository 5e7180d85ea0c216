"""The gateway in front of the real services (real nats-server, services in-process).

- Greedy completions over HTTP equal the serial oracle, under preemption and prefix hits.
- A scrape of /metrics after a workload holds every required metric, with values that
  match the workload exactly (request, token and loop counts).
- A caller's W3C traceparent: every service logs its trace id, and with an exporter the
  spans of gateway, admission, scheduler and worker form one trace, parent by parent.
- Refusals keep OpenAI's error shape and HTTP status (400, 429 + Retry-After, 503).
- With API keys, the service's /v1 routes need one (the openai client), /health does not,
  and its HTTP server is the bounded edge (a late head is dropped, deep JSON is a 400).
- Handler exceptions are counted in ``nats micro stats``.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path

import httpx
import nats
import openai
import pytest
from nats.aio.msg import Msg

from messages.sampling import SamplingParams
from services.admission.core import AdmissionConfig
from services.common.config import SchedulerConfig
from services.gateway.edge import HttpLimits
from services.gateway.protocol import MAX_BODY_BYTES
from services.gateway.service import GatewayService
from services.launcher import NatsServer
from services.oracle import SerialOracle
from services.runtime import subjects, tracing
from services.runtime.logging import configure_logging
from services.runtime.service import Endpoint, Service

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import services_up  # noqa: E402
from tests.engine_harness import assert_matches_oracle, oracle_result  # noqa: E402
from tests.gateway_helpers import (  # noqa: E402
    REQUIRED_METRICS,
    as_finished,
    gateway_up,
    metric_sums,
)
from tests.service_procs import wait_for  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]
pytestmark = [pytest.mark.services, pytest.mark.usefixtures("torch_single_thread", "fast_metrics")]

TOTAL_UT_STEPS = 4  # the toy checkpoint's


@pytest.fixture()
def fast_metrics(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    monkeypatch.setenv("RLT_METRICS_INTERVAL_S", "0.1")


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    r = await http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return metric_sums(r.text)


async def test_metrics_and_oracle_after_a_workload_with_preemption_and_prefix_hits(
    nats_server: NatsServer, toy_checkpoint: Path, oracle: SerialOracle
) -> None:
    # room for two requests' KV at a time, six at once: preemption is certain
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        num_blocks=48,
        async_scheduling=True,
        enable_prefix_caching=True,
    )
    rng = random.Random(5)
    shared = [rng.randrange(1, 400) for _ in range(8)]
    prompts = [[*shared, rng.randrange(1, 400)] for _ in range(6)]
    knobs = [{}, {"min_loops": 1, "exit_threshold": 0.7}] * 3
    max_tokens = 11
    async with (
        services_up(nats_server.url, toy_checkpoint, config),
        gateway_up(nats_server.url, toy_checkpoint) as http,
    ):
        await wait_for(lambda: _ready(http), 10, "/health ready")

        async def one(prompt: list[int], extra: dict) -> dict:
            body = {
                "model": "toy",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                **extra,
            }
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        # one request first, so its blocks are cached when the rest arrive
        answers = [await one(prompts[0], knobs[0])]
        answers += await asyncio.gather(
            *(one(p, k) for p, k in zip(prompts[1:], knobs[1:], strict=True))
        )
        n = len(prompts)

        async def settled() -> bool:
            m = await _scrape(http)
            return m.get('rlt:request_success_total{finished_reason="length"}') == n and (
                m.get("rlt:num_requests_running") == 0
            )

        await wait_for(settled, 10, "the workload on /metrics")
        m = await _scrape(http)

    # every answer equals the serial oracle (tokens and exit depths)
    for answer, prompt, extra in zip(answers, prompts, knobs, strict=True):
        choice, usage = answer["choices"][0], answer["usage"]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)
        got = as_finished(choice, usage, answer["id"])
        assert assert_matches_oracle(got, oracle_result(oracle, prompt, params, config)) > 0
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["completion_tokens"] == max_tokens == len(choice["token_ids"])
        assert usage["core_loops"] == sum(choice["exit_depths"])

    for name in REQUIRED_METRICS:
        assert name in m, name
    depths = [d for a in answers for d in a["choices"][0]["exit_depths"]]
    tokens = len(depths)
    assert m["rlt:time_to_first_token_seconds_count"] == n
    assert m["rlt:e2e_request_latency_seconds_count"] == n
    assert m["rlt:request_queue_time_seconds_count"] == n
    assert m["rlt:inter_token_latency_seconds_count"] == tokens - n
    assert m["rlt:generation_tokens_total"] == tokens
    assert m["rlt:prompt_tokens_total"] == sum(len(p) for p in prompts)
    assert m["rlt:exit_depth_count"] == tokens
    assert m["rlt:exit_depth_sum"] == sum(depths)
    assert m["rlt:decode_core_loops_total"] == sum(depths)
    assert m["rlt:loops_saved_total"] == sum(TOTAL_UT_STEPS - d for d in depths) > 0
    assert m['rlt:exit_depth_bucket{le="4.0"}'] == tokens
    assert m['rlt:exit_depth_bucket{le="1.0"}'] == depths.count(1)
    assert m["rlt:num_preemptions_total"] > 0
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert cached > 0
    assert m["rlt:prefix_cache_hits_total"] >= cached
    assert m["rlt:prefix_cache_queries_total"] >= sum(len(p) for p in prompts)
    # everything ended: no KV held, nothing queued
    assert m["rlt:kv_cache_usage_perc"] == 0.0
    assert m["rlt:num_requests_waiting"] == 0
    # the worker: one rows-per-pass sample per core pass; each pass ran at least one row
    assert m["rlt:core_passes_total"] == m["rlt:rows_per_core_pass_count"] > 0
    assert m["rlt:rows_per_core_pass_sum"] >= m["rlt:core_passes_total"]
    assert m["rlt:bus_overhead_seconds_count"] > 0
    assert m['rlt:http_requests_total{route="/v1/completions",status="200"}'] == n


async def _ready(http: httpx.AsyncClient) -> bool:
    return (await http.get("/health")).status_code == 200


async def _unavailable(http: httpx.AsyncClient) -> bool:
    r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    return r.status_code == 503


async def test_a_stopping_gateway_ends_a_long_answer_with_an_error_frame(
    nats_server: NatsServer, toy_checkpoint: Path
) -> None:
    """SIGTERM while a long answer streams: after the drain timeout its stream ends with an
    ``unavailable`` error frame and ``[DONE]`` (never a cut-off body), and the request is
    aborted upstream."""
    config = SchedulerConfig(max_num_seqs=4, block_size=16, num_blocks=1024)
    body = {"prompt": "hi", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    async with services_up(nats_server.url, toy_checkpoint, config) as services:
        gateway = GatewayService(nats_server.url, toy_checkpoint, port=0, served_model_name="toy")
        await gateway.start()
        try:
            url = f"http://127.0.0.1:{gateway.port}"
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                await wait_for(lambda: _ready(http), 10, "/health ready")
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    frames = (line async for line in r.aiter_lines() if line.startswith("data:"))
                    assert "choices" in json.loads((await anext(frames))[5:])
                    await services["worker"].stop()  # the answer stalls mid-stream
                    stopping = asyncio.create_task(gateway.stop(drain_timeout=0.3))
                    rest = [frame async for frame in frames]
                    await stopping
            assert rest[-1] == "data: [DONE]", rest[-3:]
            error = json.loads(rest[-2][5:])["error"]
            assert error["code"] == "unavailable" and "shut down" in error["message"]
            sched = services["scheduler"].driver
            await wait_for(lambda: not sched.streams, 10, "aborted upstream")
        finally:
            await gateway.stop()


async def test_traceparent_reaches_every_service_log_and_span(
    nats_server: NatsServer, toy_checkpoint: Path
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.install_exporter(exporter)
    logs = io.StringIO()
    configure_logging(stream=logs)
    trace_id, caller_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    traceparent = f"00-{trace_id}-{caller_span}-01"
    config = SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=256)
    try:
        async with (
            services_up(nats_server.url, toy_checkpoint, config),
            gateway_up(nats_server.url, toy_checkpoint) as http,
        ):
            r = await http.post(
                "/v1/completions",
                json={"prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "ignore_eos": True},
                headers={"traceparent": traceparent},
            )
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            rid = json.loads(r.text.split("\n\n")[0][6:])["id"]

            # a NATS client's traceparent header is honoured by admission too
            nats_trace = "1" * 32
            nc = await nats.connect(nats_server.url)
            try:
                inbox = nc.new_inbox()
                sub = await nc.subscribe(inbox)
                body = b'{"request_id":"nats-traced","prompt_token_ids":[4,5],"max_tokens":2}'
                await nc.publish(
                    subjects.GENERATE,
                    body,
                    reply=inbox,
                    headers={"traceparent": f"00-{nats_trace}-{'2' * 16}-01"},
                )
                while b'"finished"' not in (await sub.next_msg(timeout=30)).data:
                    pass
            finally:
                await nc.close()
            await asyncio.sleep(0.3)  # the worker's "request released" comes with a later batch
    finally:
        configure_logging()
        spans = list(exporter.get_finished_spans())
        tracing.uninstall_exporters()

    lines = [json.loads(line) for line in logs.getvalue().splitlines() if line.startswith("{")]
    mine = [e for e in lines if e.get("request_id") == rid]
    by_service = {e["service"] for e in mine if e.get("trace_id") == trace_id}
    assert by_service == {"gateway", "admission", "scheduler", "worker"}, mine
    assert {e.get("trace_id") for e in mine if "trace_id" in e} == {trace_id}
    nats_lines = [e for e in lines if e.get("request_id") == "nats-traced"]
    assert {e["service"] for e in nats_lines if e.get("trace_id") == nats_trace} >= {
        "admission",
        "scheduler",
        "worker",
    }

    ours = [s for s in spans if format(s.context.trace_id, "032x") == trace_id]
    by_name = {s.name: s for s in ours}
    assert set(by_name) == {
        "gateway.request",
        "admission.admit",
        "scheduler.request",
        "worker.request",
    }, [s.name for s in ours]
    chain = ["gateway.request", "admission.admit", "scheduler.request", "worker.request"]
    assert format(by_name[chain[0]].parent.span_id, "016x") == caller_span
    for parent, child in itertools.pairwise(chain):
        assert by_name[child].parent.span_id == by_name[parent].context.span_id, child
    for name in chain:
        assert by_name[name].attributes["rlt.request_id"] == rid
        service = name.split(".")[0]
        assert by_name[name].resource.attributes["service.name"] == f"rlt-{service}"
    for name in ("scheduler.request", "worker.request"):
        assert isinstance(by_name[name].attributes["rlt.batch_seq"], int)
    assert by_name["scheduler.request"].attributes["rlt.finish_reason"] == "length"
    assert by_name["gateway.request"].attributes["http.status_code"] == 200


async def test_refusals_keep_the_openai_error_shape_and_status(
    nats_server: NatsServer, toy_checkpoint: Path
) -> None:
    config = SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=256)
    async with gateway_up(nats_server.url, toy_checkpoint) as http:
        # nothing behind the gateway: not ready, and requests are "unavailable"
        health = await http.get("/health")
        assert health.status_code == 503
        assert health.json()["services"]["admission"] == "absent"
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "unavailable"
        r = await http.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status_code == 503  # a stream refused before it started is an HTTP error
        # a body over the gateway's limit is refused before it is all read
        huge = b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
        r = await http.post("/v1/completions", content=huge)
        assert r.status_code == 400 and "request body is over" in r.json()["error"]["message"]

        # a queue limit of 0: every request is "overloaded"
        overloaded = AdmissionConfig(max_waiting_requests=0)
        async with services_up(nats_server.url, toy_checkpoint, config, overloaded):
            await wait_for(lambda: _ready(http), 10, "/health ready")
            r = await http.post("/v1/chat/completions", json=_chat())
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "overloaded" in err["message"]
        # readiness is cached for a second, but a request that finds no admission drops it
        await wait_for(lambda: _unavailable(http), 10, "a 503 once admission is gone")
        assert (await http.get("/health")).status_code == 503
        async with services_up(nats_server.url, toy_checkpoint, config):
            await wait_for(lambda: _ready(http), 10, "/health ready")
            r = await http.post("/v1/completions", json={"prompt": [1, 99999], "max_tokens": 2})
            assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
            r = await http.post("/v1/completions", json={"prompt": "x", "model": "other"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
            r = await http.post("/v1/completions", content=b"{oops")
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            # too large for the bus: a clear 400 (a 503 would make clients retry it)
            r = await http.post("/v1/completions", json={"prompt": "x" * 1_100_000})
            err = r.json()["error"]
            assert r.status_code == 400 and "max_payload" in err["message"], err
            r = await http.post("/v1/chat/completions", json=_chat(max_tokens=2))
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
            models = (await http.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["toy"]
            assert models["data"][0]["max_model_len"] == 2048
            # client.models.retrieve, and Starlette's own errors, in OpenAI's shape
            assert (await http.get("/v1/models/toy")).json() == models["data"][0]
            r = await http.get("/v1/models/other")
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
            r = await http.get("/v1/nothing")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = await http.get("/v1/completions")
            assert r.status_code == 405 and "message" in r.json()["error"]


async def test_api_keys_and_the_bounded_edge_through_the_service(
    nats_server: NatsServer, toy_checkpoint: Path
) -> None:
    key = "sk-rlt-service"
    options = {
        "api_keys": [key],
        "metrics_api_keys": ["sk-rlt-metrics"],
        "http_limits": HttpLimits(head_timeout_s=0.3),
    }
    async with gateway_up(nats_server.url, toy_checkpoint, **options) as http:
        base = f"{str(http.base_url).rstrip('/')}/v1"
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["toy"]
        assert (await http.get("/health")).status_code == 503  # open: nothing behind it
        assert (await http.get("/metrics")).status_code == 401
        # deep JSON: a 400 before anything is sent
        deep = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        r = await http.post(
            "/v1/completions", content=deep, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        # a head left unfinished is answered 408 and closed
        reader, writer = await asyncio.open_connection(http.base_url.host, http.base_url.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408")


def _chat(**extra: object) -> dict:
    return {"messages": [{"role": "user", "content": "hello"}], **extra}


class _Flaky(Service):
    name = "flaky"

    def endpoints(self) -> Sequence[Endpoint]:
        return (Endpoint("boom", "rlt.v1.test.boom", self._boom),)

    async def _boom(self, msg: Msg) -> None:
        if msg.data == b"fail":
            raise RuntimeError("handler bug")


async def test_micro_stats_count_handler_errors(nats_server: NatsServer) -> None:
    service = _Flaky(nats_server.url)
    await service.start()
    nc = await nats.connect(nats_server.url)
    try:
        for data in (b"ok", b"fail", b"ok", b"fail"):
            await nc.publish("rlt.v1.test.boom", data)
        await nc.flush()

        async def stats() -> dict:
            msg = await nc.request(f"$SRV.STATS.{subjects.micro_name('flaky')}", b"", timeout=2)
            return json.loads(msg.data)

        async def counted() -> bool:
            boom = next(e for e in (await stats())["endpoints"] if e["name"] == "boom")
            return boom["num_requests"] == 4 and boom["num_errors"] == 2

        await wait_for(counted, 5, "micro stats")
        boom = next(e for e in (await stats())["endpoints"] if e["name"] == "boom")
        assert "handler bug" in boom["last_error"]
        assert service.health()["handler_errors"] == 2
    finally:
        await nc.close()
        await service.stop()
