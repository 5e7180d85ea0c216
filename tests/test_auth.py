"""Security against a real nats-server started with the SHIPPED deploy/nats.conf:

- unauthenticated connections and wrong passwords are refused (services fail fast with a
  clear message instead of retrying forever);
- every user is held to its subject allow-lists (a client cannot touch internal subjects, a
  service cannot publish outside its own);
- the four services and the HTTP gateway, each as its own NATS user (RLT_NATS_USER /
  RLT_NATS_PASSWORD), serve a NATS client and an HTTP client without a single permissions
  violation (the gateway's streams, health pings and metrics included), and their health
  checks work with their own credentials;
- prompts and outputs never reach the logs unless RLT_LOG_CONTENT=1.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from messages.api import FinishedEvent
from services.launcher import NatsServer, free_port
from services.runtime import bus, permissions, subjects
from services.runtime.bus import encode_json
from services.runtime.health import check as health_check

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import check_stream  # noqa: E402
from tests.service_procs import StreamCollector, service_procs, wait_for  # noqa: E402

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[1]
USERS = ("admission", "scheduler", "worker", "prefix-cache", "gateway", "client", "operator")


def _password_var(user: str) -> str:
    return f"RLT_NATS_{user.upper().replace('-', '_')}_PASSWORD"


PASSWORDS = {user: f"test-{user}-secret" for user in USERS}


@pytest.fixture(scope="module")
def secure_server() -> Iterator[NatsServer]:
    env = {**os.environ, **{_password_var(u): p for u, p in PASSWORDS.items()}}
    env[_password_var("route")] = "test-route-secret"
    conf = ROOT / "deploy" / "nats.conf"
    with NatsServer(port=free_port(), config_file=conf, env=env) as server:
        yield server


async def _connect(url: str, user: str, errors: list[str] | None = None) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(
        url,
        user=user,
        password=PASSWORDS[user],
        error_cb=on_error,
        allow_reconnect=False,
        inbox_prefix=f"_RLT_INBOX.rlt-{user}" if user not in ("client", "operator") else "_INBOX",
    )


async def test_unauthenticated_and_wrong_credentials_are_refused(
    secure_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for kwargs in ({}, {"user": "client", "password": "wrong"}, {"user": "nobody"}):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(secure_server.url, allow_reconnect=False, **kwargs)
    # a service with bad credentials stops at once with a clear message (no retry loop)
    monkeypatch.setenv("RLT_NATS_USER", "scheduler")
    monkeypatch.setenv("RLT_NATS_PASSWORD", "wrong")
    with pytest.raises(ConnectionError, match="refused our credentials"):
        await asyncio.wait_for(bus.connect(secure_server.url, "rlt-scheduler"), 10)


# (user, subject) pairs that must be refused; each user's allowed subject proves it connected
DENIED_PUBLISH = {
    "client": ["rlt.v1.sched.submit.0", "rlt.v1.worker.batch.x", "rlt.v1.prefix.events.x",
               "rlt.v1.adm.a.1", "_RLT_INBOX.rlt-admission.x",
               "$JS.API.STREAM.DELETE.RLT_PREFIX_EVENTS"],
    "admission": ["rlt.v1.worker.batch.x", "rlt.v1.prefix.events.x", "rlt.v1.worker.result.x"],
    "scheduler": ["rlt.v1.generate", "rlt.v1.sched.submit.0", "rlt.v1.worker.result.x",
                  "$JS.API.STREAM.DELETE.RLT_PREFIX_EVENTS", "$O.RLT_PREFIX_INDEX.x"],
    "worker": ["rlt.v1.sched.submit.0", "rlt.v1.worker.batch.x", "rlt.v1.generate",
               "rlt.v1.prefix.events.x"],
    "prefix-cache": ["rlt.v1.worker.batch.x", "rlt.v1.sched.submit.0", "rlt.v1.generate",
                     "rlt.v1.prefix.events.x", "$JS.API.STREAM.DELETE.RLT_PREFIX_EVENTS"],
    "gateway": ["rlt.v1.sched.submit", "rlt.v1.worker.batch.x", "_INBOX.x",
                "rlt.v1.metrics.scheduler"],
}  # fmt: skip
ALLOWED_PUBLISH = {
    "client": "rlt.v1.generate",
    "admission": "rlt.v1.sched.submit.0",
    "scheduler": "rlt.v1.worker.batch.x",
    "worker": "rlt.v1.worker.result.x",
    "prefix-cache": "_RLT_INBOX.rlt-prefix-cache.x",
    "gateway": "rlt.v1.abort",
}
DENIED_SUBSCRIBE = {
    "client": [
        "rlt.v1.generate",
        "rlt.v1.worker.>",
        "rlt.v1.sched.>",
        ">",
        "_RLT_INBOX.>",
        "_GW_INBOX.>",
        "rlt.v1.metrics.>",
    ],
    "gateway": ["_INBOX.>", "rlt.v1.sched.>", "rlt.v1.generate"],
    "worker": ["rlt.v1.sched.submit.0", "rlt.v1.generate", "_INBOX.>"],
    "prefix-cache": ["rlt.v1.worker.batch.x", "_INBOX.>"],
}


async def test_each_user_is_held_to_its_subject_allow_lists(secure_server: NatsServer) -> None:
    url = secure_server.url
    operator = await _connect(url, "operator")
    spy = await operator.subscribe(">")
    await operator.flush()
    try:
        for user, denied in DENIED_PUBLISH.items():
            errors: list[str] = []
            nc = await _connect(url, user, errors)
            for subject in denied:
                await nc.publish(subject, b"forbidden")
            await nc.publish(ALLOWED_PUBLISH[user], b"allowed")
            for subject in DENIED_SUBSCRIBE.get(user, []):
                await nc.subscribe(subject)
            await nc.flush()
            await wait_for(
                lambda errors=errors, user=user: (
                    len(errors) >= len(DENIED_PUBLISH[user]) + len(DENIED_SUBSCRIBE.get(user, []))
                ),
                5,
                f"{user}'s violations",
            )
            for subject in denied:
                # (nats-py lower-cases the server's error text)
                assert any(f'publish to "{subject.lower()}"' in e for e in errors), (user, subject)
            for subject in DENIED_SUBSCRIBE.get(user, []):
                wanted = f'subscription to "{subject.lower()}"'
                assert any(wanted in e for e in errors), (user, subject)
            await nc.close()
        # the operator saw every allowed message and none of the forbidden ones
        seen: list[tuple[str, bytes]] = []
        while True:
            try:
                msg = await spy.next_msg(timeout=0.3)
            except nats.errors.TimeoutError:
                break
            seen.append((msg.subject, msg.data))
        assert all(data != b"forbidden" for _, data in seen), seen
        assert {s for s, d in seen if d == b"allowed"} == set(ALLOWED_PUBLISH.values())
    finally:
        await operator.close()


async def test_services_as_separate_users_serve_clients_without_violations(
    secure_server: NatsServer,
    toy_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = secure_server.url
    prompt = "The harbour lights were reflected in the calm water"
    with service_procs(url, toy_checkpoint, tmp_path, ["--enable-prefix-caching"]) as procs:
        started = []
        http_port = free_port()
        for name in ("worker", "prefix-cache", "scheduler", "admission", "gateway"):
            env = {"RLT_NATS_USER": name, "RLT_NATS_PASSWORD": PASSWORDS[name]}
            args = ["--http-port", str(http_port)] if name == "gateway" else []
            started.append(procs.start(name, env=env, args=args))
        for proc in started:
            await procs.wait_ready(proc)
        client = await _connect(url, "client")
        try:
            col = await StreamCollector(client).start()
            bodies = [
                {"prompt": prompt, "max_tokens": 6, "ignore_eos": True},
                {"prompt": prompt, "max_tokens": 6, "ignore_eos": True},  # a prefix hit
                {"prompt_token_ids": [11, 12, 13, 14], "max_tokens": 4},
            ]
            for i, body in enumerate(bodies):
                await col.send(i, body)
                await col.wait_done([i], 30)
            finished = [check_stream(col.events[i]) for i in range(len(bodies))]
            assert all(isinstance(f, FinishedEvent) for f in finished), finished
            assert finished[1].num_cached_tokens > 0  # type: ignore[union-attr]
        finally:
            await client.close()
        await _through_the_gateway(http_port, prompt)
        # the container health check, with each service's own credentials
        monkeypatch.setenv("RLT_RUN_DIR", str(tmp_path))  # the services' identity files
        for name in ("worker", "prefix-cache", "scheduler", "admission", "gateway"):
            monkeypatch.setenv("RLT_NATS_USER", name)
            monkeypatch.setenv("RLT_NATS_PASSWORD", PASSWORDS[name])
            assert await health_check(name, url, 5.0) is None, name
        logs = {key: procs.logs(key) for key in procs.procs}
        for key, text in logs.items():
            assert "violation" not in text.lower(), (key, text[-2000:])

        # ---- content logging: off by default, on with RLT_LOG_CONTENT=1
        outputs = [json.dumps(f.token_ids) for f in finished]  # type: ignore[union-attr]
        texts = [f.text for f in finished if len(f.text) >= 6]  # type: ignore[union-attr]
        everything = "\n".join(logs.values())
        assert prompt not in everything and "harbour" not in everything
        assert "[11, 12, 13, 14]" not in everything and "[11,12,13,14]" not in everything
        for out in outputs:
            assert out not in everything and out.replace(" ", "") not in everything
        for text in texts:
            assert json.dumps(text)[1:-1] not in everything, text

        for name in ("scheduler", "admission"):
            procs.kill(name)
            env = {
                "RLT_NATS_USER": name,
                "RLT_NATS_PASSWORD": PASSWORDS[name],
                "RLT_LOG_CONTENT": "1",
            }
            await procs.wait_ready(procs.start(name, env=env, key=f"{name}-content"))
        client = await _connect(url, "client")
        try:
            col = await StreamCollector(client).start()
            await col.send(0, {"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
            await col.wait_done([0], 30)
            (done,) = col.terminals(0)
            assert isinstance(done, FinishedEvent)
        finally:
            await client.close()
        admission_log = procs.logs("admission-content")
        scheduler_log = procs.logs("scheduler-content")
        assert prompt in admission_log
        assert json.dumps(done.token_ids).replace(" ", "") in scheduler_log.replace(" ", "")


async def _through_the_gateway(port: int, prompt: str) -> None:
    """The gateway as its own NATS user: /health (pings), a streamed completion (its inbox,
    admission's and the scheduler's replies there) and /metrics (every service's)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:

        async def ready() -> bool:
            return (await http.get("/health")).status_code == 200

        await wait_for(ready, 15, "gateway /health")
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        # at least the finish frame and [DONE] (tokens whose text is held add none)
        assert r.text.rstrip().endswith("data: [DONE]") and r.text.count("data: ") >= 3
        assert '"finish_reason":"length"' in r.text

        async def published() -> bool:
            text = (await http.get("/metrics")).text
            return 'service="worker"' in text and "rlt:request_success_total{" in text

        await wait_for(published, 15, "every service's metrics on /metrics")


def test_rlt_up_binds_loopback_and_compose_ships_the_config(tmp_path: Path) -> None:
    import yaml

    from services.cli import build_parser

    assert build_parser().parse_args(["up"]).host == "127.0.0.1"
    with NatsServer(port=free_port()) as server:  # what `rlt up` starts by default
        assert server.proc is not None
        cmd = server.proc.args
        assert cmd[cmd.index("-a") + 1] == "127.0.0.1"  # type: ignore[union-attr]
        log = Path(server.log_path).read_text()
        assert f"Listening for client connections on 127.0.0.1:{server.port}" in log
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for node in ("nats-1", "nats-2", "nats-3"):
        # compose's own layout (secrets from files, the cluster config) is tests/test_compose.py's
        nats_svc = compose["services"][node]
        assert all(str(p).startswith("127.0.0.1:") for p in nats_svc["ports"])


TENANTS = ("acme", "beta")


async def _tenant_client(url: str, user: str, password: str, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    tenant = user.removeprefix("tenant-") if user.startswith("tenant-") else ""
    return await nats.connect(
        url,
        user=user,
        password=password,
        error_cb=on_error,
        allow_reconnect=False,
        inbox_prefix=subjects.tenant_inbox(tenant),
    )


async def test_tenants_cannot_touch_each_others_requests_or_streams(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """Two tenants and the default one, each its own NATS user (generated config), services
    as their own users. A tenant cannot abort another's request (same request_id: not
    found, it runs on), point a stream into another's inbox, publish another's subjects,
    read another's inboxes, or raise priority unless allowed; an abort reply carries no
    outputs."""
    names = permissions.all_user_names(TENANTS)
    passwords = {name: f"pw-{name}" for name in [*names, "route"]}
    conf = tmp_path / "nats.conf"
    conf.write_text(permissions.deploy_config(TENANTS))
    env = {**os.environ, **{permissions.password_var(n): p for n, p in passwords.items()}}
    with (
        NatsServer(port=free_port(), config_file=conf, env=env) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, env={"RLT_PRIORITY_TENANTS": "acme"})
        as procs,
    ):  # fmt: skip
        started = [
            procs.start(n, env={"RLT_NATS_USER": n, "RLT_NATS_PASSWORD": passwords[n]})
            for n in ("worker", "prefix-cache", "scheduler", "admission")
        ]
        for proc in started:
            await procs.wait_ready(proc)
        url = server.url
        acme_err: list[str] = []
        beta_err: list[str] = []
        default_err: list[str] = []
        acme = await _tenant_client(url, "tenant-acme", passwords["tenant-acme"], acme_err)
        beta = await _tenant_client(url, "tenant-beta", passwords["tenant-beta"], beta_err)
        default = await _tenant_client(url, "client", passwords["client"], default_err)
        try:
            seen: list[nats.aio.msg.Msg] = []
            await acme.subscribe(f"{subjects.tenant_inbox('acme')}.>", cb=_collect(seen))
            long = {"request_id": "shared-id", "prompt_token_ids": [5, 6, 7], "max_tokens": 300,
                    "ignore_eos": True, "temperature": 0.0}  # fmt: skip
            stream = acme.new_inbox()
            await acme.publish(subjects.tenant_generate("acme"), encode_json(long), reply=stream)
            await wait_for(lambda: _on(seen, stream) >= 3, 30, "acme's tokens")
            # beta aborts acme's request id on its own subject: not found, nothing stops
            answer = await beta.request(
                subjects.tenant_abort("beta"), encode_json({"request_id": "shared-id"}), 5
            )
            assert json.loads(answer.data)["code"] == "not_found"
            # beta and the default tenant point streams into acme's inbox: dropped
            hijack = f"{subjects.tenant_inbox('acme')}.hijacked"
            body = encode_json({"prompt_token_ids": [1], "max_tokens": 2})
            await beta.publish(subjects.tenant_generate("beta"), body, reply=hijack)
            await default.publish(subjects.GENERATE, body, reply=hijack)
            # beta publishes acme's subjects and reads others' inboxes: refused by NATS
            await beta.publish(subjects.tenant_generate("acme"), body, reply=hijack)
            await beta.publish(subjects.GENERATE, body)
            await beta.subscribe(f"{subjects.tenant_inbox('acme')}.>")
            await beta.subscribe("_INBOX.>")
            await default.subscribe(f"{subjects.TENANT_INBOX_ROOT}.>")
            await beta.flush()
            await default.flush()
            # priority: acme may ask for more urgent than the default, beta may not
            urgent = encode_json({"prompt_token_ids": [9, 9], "max_tokens": 2, "priority": -5})
            refused = json.loads(
                (await beta.request(subjects.tenant_generate("beta"), urgent, 10)).data
            )
            assert refused["code"] == "invalid_request" and "priority" in refused["message"]
            allowed = await acme.request(subjects.tenant_generate("acme"), urgent, 10)
            assert json.loads(allowed.data)["type"] in ("token", "finished")

            terminal = await _until_terminal(seen, stream, 60)
            assert terminal["type"] == "finished" and terminal["finish_reason"] == "length"
            assert not [m for m in seen if m.subject == hijack]
            await wait_for(lambda: len(beta_err) >= 4 and len(default_err) >= 1, 5, "refusals")
            for wanted in (
                'publish to "rlt.v1.tenant.acme.generate"',
                'publish to "rlt.v1.generate"',
                'subscription to "_inbox.tenant.acme.>"',
                'subscription to "_inbox.>"',
            ):
                assert any(wanted in e for e in beta_err), (wanted, beta_err)
            assert any('subscription to "_inbox.tenant.>"' in e for e in default_err)

            assert terminal["request_id"] == "shared-id"  # its own id, as it sent it
            # beta takes the request_id acme will use next: ids are per tenant, so acme's
            # request still runs (and beta's ran as beta's)
            squat = encode_json({"request_id": "acme-2", "prompt_token_ids": [1], "max_tokens": 1})
            taken = json.loads(
                (await beta.request(subjects.tenant_generate("beta"), squat, 10)).data
            )
            assert taken["type"] in ("token", "finished") and taken["request_id"] == "acme-2"

            # acme aborts its own request: the stream ends with abort; the abort reply is
            # an acknowledgement without the outputs
            long["request_id"] = "acme-2"
            stream2 = acme.new_inbox()
            await acme.publish(subjects.tenant_generate("acme"), encode_json(long), reply=stream2)
            await wait_for(lambda: _on(seen, stream2) >= 2, 30, "acme's second stream")
            ack = json.loads(
                (
                    await acme.request(
                        subjects.tenant_abort("acme"), encode_json({"request_id": "acme-2"}), 5
                    )
                ).data
            )
            assert ack["finish_reason"] == "abort" and ack["token_ids"] == []
            assert ack["request_id"] == "acme-2"
            ended = await _until_terminal(seen, stream2, 30)
            assert ended["finish_reason"] == "abort" and ended["token_ids"]
        finally:
            for nc in (acme, beta, default):
                await nc.close()
        assert all(p.alive() for p in procs.procs.values())


def _collect(into: list):  # type: ignore[no-untyped-def,type-arg]
    async def cb(msg) -> None:  # type: ignore[no-untyped-def]
        into.append(msg)

    return cb


def _on(seen: list, subject: str) -> int:  # type: ignore[type-arg]
    return sum(1 for m in seen if m.subject == subject)


async def _until_terminal(seen: list, subject: str, timeout: float) -> dict:  # type: ignore[type-arg]
    def terminal() -> dict | None:  # type: ignore[type-arg]
        for m in seen:
            if m.subject == subject and json.loads(m.data)["type"] != "token":
                return json.loads(m.data)
        return None

    await wait_for(lambda: terminal() is not None, timeout, f"terminal on {subject}")
    out = terminal()
    assert out is not None
    return out
