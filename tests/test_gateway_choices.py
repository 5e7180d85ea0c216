"""``n`` choices over HTTP, without NATS: the engine requests a request with ``n`` becomes,
the response and the stream built from several answers, and the whole call failing when
one choice fails (the others aborted). The HTTP app runs over a scripted backend through
httpx's ASGI transport; ``test_gateway_e2e.py`` checks the choices against the engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest, StreamEvent, TokenEvent
from services.gateway.app import build_app
from services.gateway.errors import ApiError
from services.gateway.protocol import MAX_CHOICES, parse_chat, parse_completion
from services.gateway.stream import Answer, SseEncoder, answers_body
from services.gateway.translate import Options, choice_requests, to_generate
from tests.gateway_helpers import ScriptedBackend, choice_index, token_events
from tests.gateway_helpers import json_body as _body

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------------- requests
def test_n_choices_are_n_requests_with_their_own_ids_and_seeds() -> None:
    one = to_generate(parse_completion(_body(prompt="hi", seed=7)), "cmpl-1")
    assert choice_requests(one, 1) == [one]  # one choice: the request itself, id unchanged
    req = parse_completion(_body(prompt="hi", n=3, seed=7, temperature=0.9, max_tokens=5))
    assert req.n == 3
    children = choice_requests(to_generate(req, "cmpl-1"), 3)
    assert [c.request_id for c in children] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [c.seed for c in children] == [7, 8, 9]
    assert {(c.prompt, c.temperature, c.max_tokens) for c in children} == {("hi", 0.9, 5)}
    # no seed: none is made up here (admission seeds each from its own id)
    unseeded = choice_requests(to_generate(parse_completion(_body(prompt="hi")), "c"), 2)
    assert [c.seed for c in unseeded] == [None, None]
    # a seed at the top of the range wraps into it rather than overflowing it
    top = to_generate(parse_completion(_body(prompt="hi", seed=2**63 - 1)), "c")
    assert [c.seed for c in choice_requests(top, 2)] == [2**63 - 1, 0]
    # a seed out of range is left for admission to refuse (as with one choice)
    bad = to_generate(parse_completion(_body(prompt="hi", seed=-1)), "c")
    assert [c.seed for c in choice_requests(bad, 2)] == [-1, -1]
    # best_of = n is n, any other best_of is refused; the chat endpoint takes n too
    assert parse_completion(_body(prompt="hi", n=2, best_of=2)).n == 2
    for best_of in (1, 3):
        with pytest.raises(ApiError) as err:
            parse_completion(_body(prompt="hi", n=2, best_of=best_of))
        assert err.value.param == "best_of"
    chat = parse_chat(_body(messages=[{"role": "user", "content": "hi"}], n=MAX_CHOICES))
    assert chat.n == MAX_CHOICES


def _opts(**kw: object) -> Options:
    base = {"stream": False, "include_usage": False, "stops": (), "include_stop_str": False,
            "return_token_ids": False}  # fmt: skip
    return Options(**{**base, **kw})  # type: ignore[arg-type]


def _answer(rid: str, texts: list[str], depth: int, opts: Options | None = None) -> Answer:
    answer = Answer(rid, opts or _opts())
    for i, text in enumerate(texts):
        answer.on_event(
            TokenEvent(request_id=rid, index=i, token_id=10 + i, exit_depth=depth, text=text)
        )
    answer.on_event(
        FinishedEvent(
            request_id=rid,
            finish_reason="length",
            token_ids=[10 + i for i in range(len(texts))],
            exit_depths=[depth] * len(texts),
            num_prompt_tokens=5,
            num_cached_tokens=2,
            text="".join(texts),
        )
    )
    return answer


def test_a_response_of_several_choices_counts_the_prompt_once() -> None:
    answers = [_answer("r-0", ["a", "b"], 4), _answer("r-1", ["c", "d", "e"], 2)]
    for chat in (False, True):
        body = answers_body(chat, "r", "toy", 1, answers)
        assert [c["index"] for c in body["choices"]] == [0, 1]
        texts = [c["message"]["content"] if chat else c["text"] for c in body["choices"]]
        assert texts == ["ab", "cde"]
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 5)
        assert usage["total_tokens"] == 10 and usage["core_loops"] == 2 * 4 + 3 * 2
        assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    # a stream's frames say which choice they belong to
    stream = Answer("r-3", _opts(stream=True))
    deltas = stream.on_event(
        TokenEvent(request_id="r-3", index=0, token_id=1, exit_depth=1, text="x")
    )
    frame = SseEncoder(False, "r", "toy", 1, stream.options, index=3).deltas(deltas)
    assert json.loads(frame.split(b"data: ", 1)[1])["choices"][0]["index"] == 3


# ---------------------------------------------------------------------- over HTTP
async def _post(backend: ScriptedBackend, path: str, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return await client.post(path, json=body)


def _sse(response: httpx.Response) -> list[Any]:
    frames = [line[len("data: ") :] for line in response.text.split("\n") if line]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


async def test_n_choices_answer_as_one_response() -> None:
    backend = ScriptedBackend(
        lambda r: token_events(r.request_id, [f"<{choice_index(r.request_id)}>", "!"])
    )
    r = await _post(backend, "/v1/completions", {"prompt": "hi", "n": 3, "seed": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["<0>!", "<1>!", "<2>!"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 6
    assert [g.seed for g in backend.sent] == [4, 5, 6]
    assert backend.aborted == []  # every choice ran to its end


async def test_streamed_choices_interleave_and_each_ends() -> None:
    backend = ScriptedBackend(
        lambda r: token_events(r.request_id, ["a", "b", "c"][: choice_index(r.request_id) + 1])
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = await _post(backend, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    chunks = _sse(r)
    *parts, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1 + 2 + 3
    assert all(len(c["choices"]) == 1 for c in parts)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in parts:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2]
    for i, choices in by_index.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}  # each says who
        text = "".join(c["delta"].get("content", "") for c in choices)
        assert text == "abc"[: i + 1]
        assert [c["finish_reason"] for c in choices][-1] == "length"


async def test_one_refused_choice_fails_the_call_and_aborts_the_others() -> None:
    def script(r: GenerateRequest) -> list[StreamEvent]:
        if choice_index(r.request_id) == 1:
            return [ErrorEvent(request_id=r.request_id, code="overloaded", message="full")]
        return token_events(r.request_id, ["x"], finish=False)  # still running

    backend = ScriptedBackend(script)
    for stream in (False, True):
        backend.aborted.clear()
        r = await _post(backend, "/v1/completions", {"prompt": "hi", "n": 3, "stream": stream})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert sorted(backend.aborted) == sorted(
            g.request_id for g in backend.sent[-3:] if choice_index(g.request_id) != 1
        )


async def test_a_choice_failing_mid_stream_ends_the_stream_with_its_error() -> None:
    def script(r: GenerateRequest) -> list[StreamEvent]:
        events = token_events(r.request_id, ["x", "y"], finish=False)
        if choice_index(r.request_id) == 1:
            events.append(ErrorEvent(request_id=r.request_id, code="internal", message="boom"))
        return events

    backend = ScriptedBackend(script)
    r = await _post(backend, "/v1/completions", {"prompt": "hi", "n": 2, "stream": True})
    assert r.status_code == 200  # the stream had started
    frames = [line for line in r.text.split("\n") if line]
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2][len("data: ") :])
    assert error["error"]["code"] == "internal" and error["error"]["message"] == "boom"
    assert [choice_index(rid) for rid in backend.aborted] == [0]  # the one still running


async def test_a_stop_string_ends_only_its_choice_and_aborts_its_request() -> None:
    # choice 1's first token holds the stop string; choice 0 never meets it
    def script(r: GenerateRequest) -> list[StreamEvent]:
        texts = ["a", "b", "c"] if choice_index(r.request_id) == 0 else ["zEND", "q"]
        return token_events(r.request_id, texts, finish=choice_index(r.request_id) == 0)

    for stream in (False, True):
        backend = ScriptedBackend(script)
        body = {"prompt": "hi", "n": 2, "stop": ["END"], "stream": stream}
        r = await _post(backend, "/v1/completions", body)
        assert r.status_code == 200, r.text
        if stream:
            texts, reasons = ["", ""], [None, None]
            for chunk in _sse(r):
                (c,) = chunk["choices"]
                texts[c["index"]] += c["text"]
                reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
        else:
            choices = r.json()["choices"]
            texts = [c["text"] for c in choices]
            reasons = [c["finish_reason"] for c in choices]
        assert texts == ["abc", "z"] and reasons == ["length", "stop"]
        assert [choice_index(rid) for rid in backend.aborted] == [1]  # its engine request stops


async def test_choices_stream_as_their_tokens_come() -> None:
    # choice 0's tokens at 0, 40, 80 ms, choice 1's at 20, 60 ms: the frames alternate
    def script(r: GenerateRequest) -> Any:
        i = choice_index(r.request_id)

        async def feed(put: Any) -> None:
            await asyncio.sleep(0.02 * i)
            for event in token_events(r.request_id, ["a", "b", "c"][: 3 - i]):
                put(event)
                await asyncio.sleep(0.04)

        return feed

    r = await _post(
        ScriptedBackend(script), "/v1/completions", {"prompt": "hi", "n": 2, "stream": True}
    )
    order = [c["choices"][0]["index"] for c in _sse(r) if c["choices"][0]["text"]]
    assert order == [0, 1, 0, 1, 0]


async def test_a_stopped_choice_is_aborted_while_the_others_run() -> None:
    # choice 0 goes on only once choice 1 (stopped by its first token) was aborted: a
    # gateway that waited for choice 0 before aborting choice 1 would wait for ever
    for stream in (False, True):
        backend = ScriptedBackend(None)

        def script(r: GenerateRequest, backend: ScriptedBackend = backend) -> Any:
            if choice_index(r.request_id) == 1:
                return token_events(r.request_id, ["zEND"], finish=False)

            async def feed(put: Any) -> None:
                put(token_events(r.request_id, ["a"], finish=False)[0])
                await backend.aborted_event(1).wait()
                for event in token_events(r.request_id, ["a", "b"])[1:]:
                    put(event)

            return feed

        backend.script = script
        body = {"prompt": "hi", "n": 2, "stop": ["END"], "stream": stream}
        r = await asyncio.wait_for(_post(backend, "/v1/completions", body), 2.0)
        assert r.status_code == 200, r.text
        assert [choice_index(rid) for rid in backend.aborted] == [1]


async def test_a_refusal_answers_at_once_while_another_choice_waits() -> None:
    # choice 0 has no first token until it is aborted; choice 1 is refused at once
    def script(r: GenerateRequest) -> Any:
        if choice_index(r.request_id) == 1:
            return [ErrorEvent(request_id=r.request_id, code="overloaded", message="full")]
        return []

    backend = ScriptedBackend(script)
    r = await asyncio.wait_for(_post(backend, "/v1/completions", {"prompt": "hi", "n": 2}), 2.0)
    assert r.status_code == 429
    assert [choice_index(rid) for rid in backend.aborted] == [0]


async def test_a_client_gone_before_any_token_aborts_every_choice() -> None:
    backend = ScriptedBackend(lambda r: [])  # nothing ever comes
    app = build_app(backend)
    body = json.dumps({"prompt": "hi", "n": 3}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("t", 80), "client": ("c", 1), "root_path": ""}  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 2.0)
    assert sorted(choice_index(rid) for rid in backend.aborted) == [0, 1, 2]


async def test_a_choice_that_cannot_be_sent_aborts_those_sent_before_it() -> None:
    backend = ScriptedBackend(
        lambda r: token_events(r.request_id, ["x"], finish=False), fail_open=1
    )
    transport = httpx.ASGITransport(app=build_app(backend), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        r = await client.post("/v1/completions", json={"prompt": "hi", "n": 3})
    assert r.status_code == 500
    assert [choice_index(g.request_id) for g in backend.sent] == [0]  # 1 failed, 2 never went
    # 0 went out, 1 may have before its send failed: both are aborted, never 2
    assert [choice_index(rid) for rid in backend.aborted] == [0, 1]
