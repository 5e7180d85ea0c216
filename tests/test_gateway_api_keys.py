"""API keys on the gateway: ``Authorization: Bearer <key>`` on ``/v1/*`` (and, with a metrics
key, on ``/metrics``), ``/health`` open; the keys from ``--api-key`` / ``--api-key-file`` /
``$RLT_API_KEY``; ``rlt up``'s gateway process gets them in its environment. Through the
``openai`` client against the gateway's own HTTP server over a scripted backend (no NATS);
``test_gateway_services.py`` checks the service's wiring."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import httpx
import openai
import pytest

from services.common.service_flags import (
    add_http_flags,
    api_keys_from_args,
    metrics_api_keys_from_args,
)
from services.gateway.auth import ApiKeys
from services.gateway.process import GatewayProcess, _answers_http, bind_http
from services.runtime.logging import configure_logging
from tests.gateway_helpers import ScriptedBackend, http_served, metric_sums, token_events

pytestmark = pytest.mark.unit

KEY, OTHER_KEY, METRICS_KEY = "sk-rlt-first", "sk-rlt-second", "sk-rlt-metrics"


def test_keys_allow_only_a_bearer_of_one_of_them() -> None:
    keys = ApiKeys([KEY, OTHER_KEY])
    for header in (f"Bearer {KEY}", f"bearer {OTHER_KEY}", f"  Bearer   {KEY}  "):
        assert keys.allows(header.encode()), header
    for header in (None, b"", KEY.encode(), f"Basic {KEY}".encode(), b"Bearer ",
                   f"Bearer {KEY}x".encode(), f"Bearer {KEY[:-1]}".encode()):  # fmt: skip
        assert not keys.allows(header), header
    assert ApiKeys().allows(None) and not ApiKeys()  # no keys: open
    assert KEY not in repr(keys) and len(keys) == 2


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_http_flags(parser)
    return parser.parse_args(list(argv))


def test_keys_come_from_the_flags_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RLT_API_KEY", raising=False)
    monkeypatch.delenv("RLT_METRICS_API_KEY", raising=False)
    assert api_keys_from_args(_args()) == () and metrics_api_keys_from_args(_args()) == ()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{OTHER_KEY}\n\n  third  \n")
    args = _args("--api-key", KEY, "--api-key-file", str(keys_file))
    assert api_keys_from_args(args) == (KEY, OTHER_KEY, "third")
    # the environment, one key a line, when no flag names a key
    monkeypatch.setenv("RLT_API_KEY", f"{KEY}\n{OTHER_KEY}\n")
    monkeypatch.setenv("RLT_METRICS_API_KEY", METRICS_KEY)
    assert api_keys_from_args(_args()) == (KEY, OTHER_KEY)
    assert api_keys_from_args(_args("--api-key", "flag")) == ("flag",)
    assert metrics_api_keys_from_args(_args()) == (METRICS_KEY,)
    # what would leave the API open while the operator asked for keys fails the start
    empty = tmp_path / "empty"
    empty.write_text("\n \n")
    for argv in (["--api-key-file", str(empty)], ["--api-key-file", str(tmp_path / "none")],
                 ["--api-key", ""], ["--api-key", " spaced"], ["--api-key", "a\r\nb"]):  # fmt: skip
        with pytest.raises(SystemExit):
            api_keys_from_args(_args(*argv))


def _client(url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


async def test_the_openai_client_needs_a_key_and_health_stays_open() -> None:
    logs = io.StringIO()
    configure_logging(stream=logs)  # before the backend binds its logger
    backend = ScriptedBackend(lambda r: token_events(r.request_id, ["o", "k"]))
    try:
        async with (
            http_served(backend, api_keys=[KEY, OTHER_KEY]) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            for wrong in ("sk-wrong", f"{KEY}x", KEY[:-1]):
                with pytest.raises(openai.AuthenticationError) as err:
                    await _client(url, wrong).models.list()
                assert err.value.status_code == 401
                assert err.value.code == "invalid_api_key"
                assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
            with pytest.raises(openai.AuthenticationError):
                await _client(url, "sk-wrong").completions.create(model="toy", prompt="hi")
            for key in (KEY, OTHER_KEY):
                client = _client(url, key)
                assert [m.id for m in (await client.models.list()).data] == ["toy"]
                done = await client.completions.create(model="toy", prompt="hi", max_tokens=2)
                assert done.choices[0].text == "ok"
                chat = await client.chat.completions.create(
                    model="toy", messages=[{"role": "user", "content": "hi"}]
                )
                assert chat.choices[0].message.content == "ok"
            # without a key: a 401 names the scheme; /health and /metrics stay open
            r = await http.post("/v1/chat/completions", json={})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert (await http.get("/v1/nothing")).status_code == 401  # every /v1 path
            assert (await http.get("/health")).status_code == 200
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200
    finally:
        configure_logging()
    counts = metric_sums(metrics.text)
    assert counts['rlt:http_requests_total{route="/v1/models",status="401"}'] == 3
    assert counts['rlt:http_requests_total{route="/v1/completions",status="401"}'] == 1
    assert counts['rlt:http_requests_total{route="other",status="401"}'] == 1
    assert len(backend.sent) == 4  # only the requests with a key reached the engine
    text = logs.getvalue()
    assert "http request without a valid API key" in text
    for key in (KEY, OTHER_KEY, "sk-wrong"):
        assert key not in text  # keys are never logged


async def test_a_metrics_key_guards_metrics_alone() -> None:
    backend = ScriptedBackend(lambda r: token_events(r.request_id, ["x"]))
    async with (
        http_served(backend, api_keys=[KEY], metrics_api_keys=[METRICS_KEY]) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):

        def bearer(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers=bearer(KEY))).status_code == 401
        r = await http.get("/metrics", headers=bearer(METRICS_KEY))
        assert r.status_code == 200 and "rlt:http_requests_total" in r.text
        assert (await http.get("/v1/models", headers=bearer(METRICS_KEY))).status_code == 401
        assert (await http.get("/v1/models", headers=bearer(KEY))).status_code == 200
        assert (await http.get("/health")).status_code == 200
    # a metrics key alone leaves the API open
    async with (
        http_served(backend, metrics_api_keys=[METRICS_KEY]) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        assert (await http.get("/v1/models")).status_code == 200
        assert (await http.get("/metrics")).status_code == 401


async def test_rlt_ups_gateway_process_gets_its_keys_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLT_API_KEY", "from-the-shell")
    process = GatewayProcess(
        "nats://127.0.0.1:4222", tmp_path, port=0, api_keys=[KEY, OTHER_KEY],
        metrics_api_keys=[METRICS_KEY],
    )  # fmt: skip
    assert process.env["RLT_API_KEY"] == f"{KEY}\n{OTHER_KEY}"
    assert process.env["RLT_METRICS_API_KEY"] == METRICS_KEY
    process._socket = bind_http("127.0.0.1", 0)  # what its start binds
    try:
        assert not any(KEY in part for part in process.command())  # never on a command line
    finally:
        process._socket.close()
    # none given: none, whatever the shell's environment holds
    assert "RLT_API_KEY" not in GatewayProcess("nats://127.0.0.1:4222", tmp_path).env
    # its readiness probe sends the key
    backend = ScriptedBackend(lambda r: [])
    async with http_served(backend, api_keys=[KEY]) as url:
        host, port = url.removeprefix("http://").split(":")
        assert await _answers_http(host, int(port), KEY)
        assert not await _answers_http(host, int(port))
