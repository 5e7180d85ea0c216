"""The HTTP gateway of a real ``rlt up`` (the four services in one process, nats-server and
the gateway in child processes), driven by the official ``openai`` client, ``curl -N`` and
httpx:

- completions and chat completions, streamed and not: greedy tokens and exit depths equal
  the serial oracle, usage numbers are right, string stops cut the text; log-probabilities
  (of the generated tokens, and of an echoed prompt as lm-eval asks) equal the oracle's;
- usage: a repeated prompt's prefix-cache hit in ``cached_tokens``, and vLLM's continuous
  usage on every streamed frame;
- server-sent events leave as tokens are made: the first frame reaches curl before the
  scheduler finished the request (its log says when);
- a client that disconnects mid-stream has its request aborted and its KV freed, seen
  through /metrics;
- a caller's ``traceparent`` is the trace id in the log lines of every service;
- the gateway is a process of its own, with no NATS password on its command line; killed,
  it is started again and serves the oracle's tokens; stopping ``rlt up`` stops it, and so
  does killing it; an HTTP port in use fails ``rlt up`` with a clear message and leaves no
  process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from messages.sampling import SamplingParams
from services.bench.processes import child_pid, child_pids, cmdline
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.launcher import free_port
from services.oracle import SerialOracle
from tests.engine_harness import assert_matches_oracle, oracle_result
from tests.gateway_helpers import as_finished, metric_sums
from tests.service_procs import alive, start_rlt_up

pytestmark = pytest.mark.services

MODEL = "toy-ckpt"


@dataclass
class Up:
    http_url: str
    log: Path
    proc: subprocess.Popen[str]

    def log_lines(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out


@pytest.fixture(scope="module")
def up(toy_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    workdir = tmp_path_factory.mktemp("rlt-up")
    log = workdir / "rlt-up.log"
    http_port = free_port()
    env = {**_up_env(workdir), "RLT_METRICS_INTERVAL_S": "0.2"}
    cmd = _up_command(toy_checkpoint, free_port(), http_port, workdir)
    cmd += ["--served-model-name", MODEL, "--async-scheduling", "--enable-prefix-caching"]
    proc, _ = start_rlt_up(cmd, env, log, timeout_s=90)
    try:
        yield Up(f"http://127.0.0.1:{http_port}", log, proc)
        children = child_pids(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        # nats-server and the gateway went with it
        assert children and not [pid for pid in children if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _client(up: Up) -> OpenAI:
    return OpenAI(base_url=f"{up.http_url}/v1", api_key="not-needed", max_retries=0)


GREEDY = {"ignore_eos": True, "return_token_ids": True, "min_loops": 1, "exit_threshold": 0.7}
PARAMS = SamplingParams(
    max_tokens=9, temperature=0.0, ignore_eos=True, min_loops=1, exit_threshold=0.7
)
CONFIG = SchedulerConfig()  # rlt up's defaults: the oracle only needs the KV layout


def _check_oracle(oracle: SerialOracle, prompt: list[int], token_ids, depths, reason) -> None:
    got = as_finished(
        {"finish_reason": reason, "token_ids": token_ids, "exit_depths": depths},
        {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": 0}},
        "x",
    )
    assert assert_matches_oracle(got, oracle_result(oracle, prompt, PARAMS, CONFIG)) > 0


def test_openai_client_completions_equal_the_oracle(
    up: Up, oracle: SerialOracle, codec: TextCodec
) -> None:
    client = _client(up)
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = [17, 42, 99, 5, 230, 8]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, extra_body=GREEDY
    )
    choice = r.choices[0]
    ids, depths = choice.model_extra["token_ids"], choice.model_extra["exit_depths"]
    _check_oracle(oracle, prompt, ids, depths, choice.finish_reason)
    assert choice.text == codec.decode(ids)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 9
    assert r.usage.total_tokens == len(prompt) + 9
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.model_extra["core_loops"] == sum(depths)
    assert r.usage.model_extra["mean_exit_depth"] == pytest.approx(sum(depths) / 9)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=GREEDY,
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 9
    assert last.usage.model_extra["core_loops"] == sum(depths)
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == ids
    assert body[-1].choices[0].finish_reason == "length"

    # a stop string cuts the text where it first appears (it is not in the output)
    text = choice.text
    stop = text[3:5]
    cut = text[: text.find(stop)]
    for stream in (False, True):
        resp = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=9,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body=GREEDY,
        )
        if stream:
            parts = list(resp)
            got = "".join(c.choices[0].text for c in parts)
            reason = parts[-1].choices[0].finish_reason
        else:
            got, reason = resp.choices[0].text, resp.choices[0].finish_reason
        assert (got, reason) == (cut, "stop"), stream


def test_openai_client_chat_equals_the_oracle(
    up: Up, oracle: SerialOracle, codec: TextCodec
) -> None:
    client = _client(up)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ]
    prompt = codec.encode_chat(messages, add_generation_prompt=True)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, temperature=0, extra_body=GREEDY
    )
    choice = r.choices[0]
    ids, depths = choice.model_extra["token_ids"], choice.model_extra["exit_depths"]
    _check_oracle(oracle, prompt, ids, depths, choice.finish_reason)
    assert choice.message.role == "assistant" and choice.message.content == codec.decode(ids)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 9

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert chunks[-1].usage.completion_tokens == 9


def test_usage_reports_cached_tokens_and_streams_it_on_every_frame(up: Up) -> None:
    """A repeated prompt reports the prefix cache's hit in ``cached_tokens``; with vLLM's
    ``continuous_usage_stats`` every streamed frame carries the usage so far."""
    client = _client(up)
    block = CONFIG.block_size
    prompt = [(11 * i) % 300 + 3 for i in range(4 * block + 3)]
    first = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=GREEDY
    )
    again = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=GREEDY
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every whole block of the prompt but the one holding its last token
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (len(prompt) - 1) // block * block, cached

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to nine."}],
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks), "a frame without usage"
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert prompt_tokens > 0 and all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 9, counts
    framed = [c for c in chunks if c.choices and c.choices[0].delta.content]
    # a frame with text counts every token framed up to it
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert len(ids) == 9 and framed[-1].usage.completion_tokens <= 9
    for c in chunks:
        assert c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens

    # without it, only the last frame has usage (OpenAI's rule)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_n_choices_equal_the_engine_with_their_seeds(
    up: Up, oracle: SerialOracle, codec: TextCodec, toy_checkpoint: Path
) -> None:
    """``n`` choices through the openai client: greedy, every choice is the oracle's answer;
    sampled with a seed, choice i is what the in-process engine makes with seed + i (vLLM's
    rule), streamed or not; usage counts the prompt once."""
    client = _client(up)
    prompt = [17, 42, 99, 5, 230, 8]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, n=2, extra_body=GREEDY
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        ids, depths = choice.model_extra["token_ids"], choice.model_extra["exit_depths"]
        _check_oracle(oracle, prompt, ids, depths, choice.finish_reason)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 2 * 9

    sampled = {"temperature": 1.0, "top_p": 1.0, "seed": 11}
    extra = {**GREEDY, "top_k": 0}
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, n=3, extra_body=extra, **sampled
    )
    engine = LLMEngine.from_checkpoint(toy_checkpoint, CONFIG)
    params = [
        SamplingParams(max_tokens=9, temperature=1.0, top_p=1.0, top_k=0, seed=11 + i,
                       ignore_eos=True, min_loops=1, exit_threshold=0.7)
        for i in range(3)
    ]  # fmt: skip
    want = engine.generate([prompt] * 3, params)
    got = [(c.model_extra["token_ids"], c.model_extra["exit_depths"]) for c in r.choices]
    assert got == [(w.token_ids, w.exit_depths) for w in want]
    assert len({tuple(ids) for ids, _ in got}) > 1  # the seeds differ, so do the samples
    assert [c.text for c in r.choices] == [codec.decode(w.token_ids) for w in want]
    assert r.usage.completion_tokens == 27
    assert r.usage.model_extra["core_loops"] == sum(sum(d) for _, d in got)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=9,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **sampled,
        )
    )
    *body, last = chunks
    assert last.usage.completion_tokens == 27 and last.usage.prompt_tokens == len(prompt)
    texts, ids = ["", "", ""], [[], [], []]
    for chunk in body:
        (c,) = chunk.choices
        texts[c.index] += c.text
        ids[c.index] += c.model_extra["token_ids"]
    assert texts == [c.text for c in r.choices]
    assert ids == [w.token_ids for w in want]

    messages = [{"role": "user", "content": "Name a prime number."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, n=2, extra_body=extra, **sampled
    )
    chat_prompt = codec.encode_chat(messages, add_generation_prompt=True)
    want = engine.generate([chat_prompt] * 2, params[:2])
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.model_extra["token_ids"] for c in chat.choices] == [w.token_ids for w in want]
    assert [c.message.content for c in chat.choices] == [codec.decode(w.token_ids) for w in want]
    assert all(c.message.role == "assistant" for c in chat.choices)
    assert chat.usage.prompt_tokens == len(chat_prompt) and chat.usage.completion_tokens == 18


def test_openai_client_logprobs_equal_the_oracle(
    up: Up, oracle: SerialOracle, codec: TextCodec
) -> None:
    """Each token's log-probability and its alternatives, through both endpoints and a
    stream, equal the oracle's log-softmax at the token's exit depth."""
    client = _client(up)
    prompt = [17, 42, 99, 5, 230, 8]
    want = oracle.generate(prompt, max_tokens=9, min_loops=1, exit_threshold=0.7)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, logprobs=3, extra_body=GREEDY
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert lp.tokens == [codec.piece(t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([s.logprob for s in want.steps], abs=1e-4)
    for top, step in zip(lp.top_logprobs, want.steps, strict=True):
        # the three most likely, and the token itself (greedy: one of them)
        expected = {codec.piece(t): v for t, v in step.top_logprobs[:3]}
        assert top == pytest.approx(expected, abs=1e-4)
    # offsets count the tokens' own texts, as vLLM's do
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(9)]

    messages = [{"role": "user", "content": "Name a prime number."}]
    chat_prompt = codec.encode_chat(messages, add_generation_prompt=True)
    want = oracle.generate(chat_prompt, max_tokens=9, min_loops=1, exit_threshold=0.7)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=9,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body=GREEDY,
    )
    content = [
        c
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [c.token for c in content] == [codec.piece(t) for t in want.token_ids]
    for c, step in zip(content, want.steps, strict=True):
        assert c.logprob == pytest.approx(step.logprob, abs=1e-4)
        assert c.bytes == list(c.token.encode())
        assert [t.token for t in c.top_logprobs] == [
            codec.piece(t) for t, _ in step.top_logprobs[:2]
        ]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(
            [v for _, v in step.top_logprobs[:2]], abs=1e-4
        )


def test_an_echo_scores_the_prompt_as_lm_eval_asks(
    up: Up, oracle: SerialOracle, codec: TextCodec
) -> None:
    """lm-eval's loglikelihood request (echo, logprobs=1, one token): the prompt's tokens,
    each scored by the oracle's full-depth prediction, then the generated token."""
    client = _client(up)
    prompt = [17, 42, 99, 5, 230, 8, 31, 4]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    logprobs = torch.log_softmax(oracle.prompt_logits(prompt), dim=-1)
    want = [float(logprobs[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert lp.tokens[: len(prompt)] == [codec.piece(t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    for p in range(1, len(prompt)):  # the best alternative, and the prompt token itself
        best = int(torch.argmax(logprobs[p - 1]))
        assert lp.top_logprobs[p][codec.piece(best)] == pytest.approx(
            float(logprobs[p - 1, best]), abs=1e-4
        )
    generated = oracle.generate(prompt, max_tokens=1, ignore_eos=True)
    assert lp.token_logprobs[-1] == pytest.approx(generated.steps[0].logprob, abs=1e-4)
    assert len(lp.tokens) == len(prompt) + 1
    assert r.choices[0].text == codec.decode(prompt) + codec.decode(generated.token_ids)
    assert r.usage.completion_tokens == 1  # the echo is not generated

    # vLLM's prompt_logprobs field, on the chat endpoint
    messages = [{"role": "user", "content": "Name a prime number."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    scored = chat.model_extra["prompt_logprobs"]  # vLLM: in the response, not the choice
    chat_prompt = codec.encode_chat(messages, add_generation_prompt=True)
    logprobs = torch.log_softmax(oracle.prompt_logits(chat_prompt), dim=-1)
    assert scored[0] is None and len(scored) == len(chat_prompt)
    for p in range(1, len(chat_prompt)):
        entry = scored[p][str(chat_prompt[p])]
        assert entry["logprob"] == pytest.approx(float(logprobs[p - 1, chat_prompt[p]]), abs=1e-4)


def test_curl_sees_the_first_frame_before_the_last_token_exists(up: Up) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
    cmd = ["curl", "-sN", f"{up.http_url}/v1/completions", "-H", "Content-Type: application/json"]
    cmd += ["-d", json.dumps({**body, "stream": True})]
    curl = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    arrivals: list[tuple[float, str]] = []
    assert curl.stdout is not None
    for line in curl.stdout:
        if line.startswith("data: "):
            arrivals.append((time.time(), line[6:].strip()))
    assert curl.wait(timeout=30) == 0
    assert arrivals[-1][1] == "[DONE]"
    first_at, first = arrivals[0]
    rid = json.loads(first)["id"]
    finished = [
        e
        for e in up.log_lines()
        if e.get("request_id") == rid and e.get("event") == "request finished"
    ]
    assert len(finished) == 1
    # the scheduler logged the request finished (its last token made) after curl had the
    # first frame in hand
    finished_at = datetime.fromisoformat(finished[0]["timestamp"]).timestamp()
    assert first_at < finished_at, (first_at, finished_at)
    frames = [json.loads(f) for _, f in arrivals[:-1]]
    assert frames[-1]["choices"][0]["finish_reason"] == "length"


def test_a_client_that_disconnects_frees_its_kv(up: Up) -> None:
    with httpx.Client(base_url=up.http_url, timeout=30) as http:

        def metrics() -> dict[str, float]:
            return metric_sums(http.get("/metrics").text)

        aborted_before = metrics().get('rlt:request_success_total{finished_reason="abort"}', 0)
        body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 1800, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            rid = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
            # the request holds KV while it streams (what the scrape must show going away)
            deadline = time.monotonic() + 10
            while True:
                m = metrics()
                if m["rlt:num_requests_running"] == 1 and m["rlt:kv_cache_usage_perc"] > 0:
                    break
                assert time.monotonic() < deadline, m
                next(lines)
                time.sleep(0.05)
        gone_at = time.monotonic()  # the connection is closed here
        deadline = gone_at + 10
        while True:
            m = metrics()
            abort = m.get('rlt:request_success_total{finished_reason="abort"}', 0)
            if abort >= aborted_before + 1 and m["rlt:num_requests_running"] == 0:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
    assert m["rlt:kv_cache_usage_perc"] == 0.0
    assert m["rlt:http_client_disconnects_total"] >= 1
    ended = [e for e in up.log_lines() if e.get("request_id") == rid]
    assert any(
        e.get("event") == "request finished" and e["finish_reason"] == "abort" for e in ended
    )
    # aborted, not finished: far fewer tokens than asked for
    assert all(e.get("num_tokens", 0) < 1800 for e in ended)


def test_a_traceparent_is_in_every_service_log(up: Up) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    client = _client(up)
    r = client.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    deadline = time.monotonic() + 10
    while True:
        mine = [e for e in up.log_lines() if e.get("request_id") == r.id]
        services = {e["service"] for e in mine if e.get("trace_id") == trace_id}
        if services >= {"gateway", "admission", "scheduler", "worker"}:
            break
        assert time.monotonic() < deadline, mine
        time.sleep(0.1)
    assert {e["trace_id"] for e in mine if "trace_id" in e} == {trace_id}


def _up_command(checkpoint: Path, nats_port: int, http_port: int, workdir: Path) -> list[str]:
    """A bare ``rlt up`` (the module's ``up`` fixture adds its own flags)."""
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(nats_port)]
    cmd += ["--http-port", str(http_port), "--checkpoint", str(checkpoint)]
    return [*cmd, "--client-url-file", str(workdir / "client-url")]


def _up_env(workdir: Path) -> dict[str, str]:
    return {**os.environ, "RLT_RUN_DIR": str(workdir), "OMP_NUM_THREADS": "1"}


def test_the_gateway_is_its_own_process_and_comes_back(up: Up, oracle: SerialOracle) -> None:
    # last in this module: it kills the gateway the other tests use
    pid = child_pid(up.proc.pid, "gateway")
    assert pid is not None and pid != up.proc.pid
    argv = cmdline(pid)
    nats_url = argv[argv.index("--nats-url") + 1]
    assert "@" not in nats_url  # the credentials travel in its environment, not here
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        again = child_pid(up.proc.pid, "gateway")
        if again not in (None, pid):
            try:
                if httpx.get(f"{up.http_url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, "the gateway did not come back"
        time.sleep(0.2)
    assert any(
        e.get("event") == "gateway process exited; starting it again" for e in up.log_lines()
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    r = _client(up).completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, extra_body=GREEDY
    )
    choice = r.choices[0]
    extra = choice.model_extra
    _check_oracle(oracle, prompt, extra["token_ids"], extra["exit_depths"], choice.finish_reason)


def test_an_http_port_in_use_fails_rlt_up_clearly(toy_checkpoint: Path, tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port, nats_port = taken.getsockname()[1], free_port()
    cmd, env = _up_command(toy_checkpoint, nats_port, port, tmp_path), _up_env(tmp_path)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    finally:
        taken.close()
    assert done.returncode == 1
    assert f"the gateway cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert "rlt is up" not in done.stdout
    # its nats-server went with it
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    assert not [pid for pid in pids if str(nats_port) in cmdline(pid)]


def test_a_killed_rlt_up_takes_its_gateway_with_it(toy_checkpoint: Path, tmp_path: Path) -> None:
    cmd = _up_command(toy_checkpoint, free_port(), free_port(), tmp_path)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_up_env(tmp_path)
    )
    children: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "rlt is up" in line:
                break
        children = child_pids(proc.pid)
        gateway = child_pid(proc.pid, "gateway")
        assert gateway is not None
        proc.kill()  # no chance to stop anything
        proc.wait()
        deadline = time.monotonic() + 20
        while alive(gateway):
            assert time.monotonic() < deadline, "the gateway outlived rlt up"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:  # nats-server has no such watch: it is ours to clean up
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
