"""Token-sparse prefill's arithmetic (services/common/sparse_prefill.py) and its request
options: counts per loop, windows, and what a request or a server may ask."""

from __future__ import annotations

import itertools
import math

import pytest

from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.sparse_prefill import (
    FLASHLOOP_RETENTION,
    SparseDefaults,
    SparseSchedule,
    default_retention,
    resolve_sparse_prefill,
)

pytestmark = pytest.mark.unit


def test_flashloop_defaults_keep_a_quarter_then_a_tenth() -> None:
    schedule = SparseSchedule.of(1024, FLASHLOOP_RETENTION)
    assert schedule.first_sparse_loop == 2
    assert [schedule.is_sparse(loop) for loop in range(4)] == [False, False, True, True]
    assert schedule.active_counts(1000) == [1000, 1000, 250, 100]
    # 2.35 of 4 loops per token on a long prompt
    assert sum(schedule.active_counts(1000)) / 1000 == pytest.approx(2.35)
    assert schedule.active_counts(30) == [30, 30, 8, 3]
    assert schedule.active_counts(1) == [1, 1, 1, 1]
    assert default_retention(4) == FLASHLOOP_RETENTION
    assert default_retention(6) == (1.0, 1.0, 0.25, 0.1, 0.1, 0.1)
    assert default_retention(2) == (1.0, 1.0)


def test_counts_are_nested_even_when_retention_rises() -> None:
    schedule = SparseSchedule.of(64, (1.0, 0.5, 1.0, 0.3))
    assert schedule.first_sparse_loop == 1
    assert schedule.active_counts(10) == [10, 5, 5, 3]
    for length in range(1, 70):
        counts = schedule.active_counts(length)
        assert all(a >= b >= 1 for a, b in itertools.pairwise(counts))
        assert counts[1] == min(max(1, math.ceil(length * 0.5)), length)


def test_windows_are_anchored_at_absolute_positions() -> None:
    schedule = SparseSchedule.of(8, FLASHLOOP_RETENTION)
    assert schedule.window_bounds(0, 20) == (0, 8)
    assert schedule.window_bounds(9, 20) == (8, 16)
    assert schedule.window_bounds(19, 20) == (16, 20)
    assert schedule.last_reusable_position(20) == 16
    assert schedule.last_reusable_position(16) == 8  # a whole last window holds the last token
    # the hash key tells window and retention apart
    keys = {
        SparseSchedule.of(8, FLASHLOOP_RETENTION).cache_key(),
        SparseSchedule.of(16, FLASHLOOP_RETENTION).cache_key(),
        SparseSchedule.of(8, (1.0, 1.0, 0.5, 0.1)).cache_key(),
    }
    assert len(keys) == 3


OFF = SparseDefaults()


def _resolve(params: SamplingParams, defaults: SparseDefaults = OFF, split: bool = True):
    return resolve_sparse_prefill(params, defaults, 4, split_prefill=split)


def test_requests_choose_or_take_the_servers_default() -> None:
    on = SparseDefaults(enabled=True, window=64)
    assert _resolve(SamplingParams()) is None
    assert _resolve(SamplingParams(), on) == SparseSchedule.of(64, FLASHLOOP_RETENTION)
    assert _resolve(SamplingParams(token_sparse_prefill=False), on) is None
    asked = _resolve(SamplingParams(token_sparse_prefill=True))
    assert asked is not None and asked.retention == FLASHLOOP_RETENTION
    # a retention alone turns it on
    mine = _resolve(SamplingParams(prefill_retention=[1, 1, 0.5, 0.2]))
    assert mine is not None and mine.retention == (1.0, 1.0, 0.5, 0.2)
    # the server's default gives way to prompt logprobs, an explicit ask does not
    assert _resolve(SamplingParams(prompt_logprobs=1), on) is None


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (SamplingParams(token_sparse_prefill=True, prompt_logprobs=0), "prompt_logprobs"),
        (SamplingParams(prefill_retention=[0.5, 1, 1, 1]), "start with 1"),
        (SamplingParams(prefill_retention=[1, 1, 0, 0.1]), "(0, 1]"),
        (SamplingParams(prefill_retention=[1, 1, 1.5, 0.1]), "(0, 1]"),
        (SamplingParams(prefill_retention=[]), "1 to 64"),
        (SamplingParams(prefill_retention=[1, True, 0.5, 0.1]), "(0, 1]"),
        (
            SamplingParams(token_sparse_prefill=False, prefill_retention=[1, 1, 0.5, 0.1]),
            "needs token_sparse_prefill",
        ),
    ],
)
def test_bad_requests_are_refused_by_name(params: SamplingParams, words: str) -> None:
    with pytest.raises(
        RequestError, match=f"(?i).*{words.replace('(', '[(]').replace(')', '[)]')}"
    ):
        params.validate()


def test_model_and_engine_checks() -> None:
    with pytest.raises(RequestError, match="4 loops"):
        _resolve(SamplingParams(prefill_retention=[1, 1, 0.5]))
    with pytest.raises(RequestError, match="atomic prefill"):
        _resolve(SamplingParams(token_sparse_prefill=True), split=False)
    # atomic prefill refuses only requests that ask: the default is off
    assert _resolve(SamplingParams(), split=False) is None


def test_server_flags_round_trip_and_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from services.common.config import SchedulerConfig
    from services.common.flags import add_engine_flags, engine_args, scheduler_config_from_args

    config = SchedulerConfig(
        token_sparse_prefill=True, prefill_retention=(1.0, 1.0, 0.5, 0.125), sparse_window=96
    )
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    back = scheduler_config_from_args(parser.parse_args(engine_args(config)))
    assert (back.token_sparse_prefill, back.prefill_retention, back.sparse_window) == (
        True,
        (1.0, 1.0, 0.5, 0.125),
        96,
    )
    assert not scheduler_config_from_args(parser.parse_args([])).token_sparse_prefill
    # compose sets them through the environment
    monkeypatch.setenv("RLT_SPARSE_PREFILL", "1")
    monkeypatch.setenv("RLT_PREFILL_RETENTION", "1,1,0.3,0.2")
    monkeypatch.setenv("RLT_SPARSE_WINDOW", "64")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    env = scheduler_config_from_args(parser.parse_args([]))
    assert (env.token_sparse_prefill, env.prefill_retention, env.sparse_window) == (
        True,
        (1.0, 1.0, 0.3, 0.2),
        64,
    )
    off = scheduler_config_from_args(parser.parse_args(["--no-token-sparse-prefill"]))
    assert not off.token_sparse_prefill
    # a service started with a config (rlt up's children) inherits this environment: its
    # flags say the config's setting, whatever the environment would default to
    plain = SchedulerConfig()
    back = scheduler_config_from_args(parser.parse_args(engine_args(plain)))
    assert (back.token_sparse_prefill, back.prefill_retention) == (False, None)


def test_http_extra_body_fields_reach_the_nats_api() -> None:
    from services.gateway.errors import ApiError
    from services.gateway.protocol import parse_chat, parse_completion
    from services.gateway.translate import to_generate
    from tests.gateway_helpers import json_body

    req = to_generate(
        parse_completion(
            json_body(prompt="x", token_sparse_prefill=True, prefill_retention=[1, 1, 0.5, 0.2])
        ),
        "r",
    )
    assert (req.token_sparse_prefill, req.prefill_retention) == (True, [1.0, 1.0, 0.5, 0.2])
    chat = to_generate(
        parse_chat(
            json_body(messages=[{"role": "user", "content": "x"}], token_sparse_prefill=False)
        ),
        "r",
    )
    assert chat.token_sparse_prefill is False and chat.prefill_retention is None
    plain = to_generate(parse_completion(json_body(prompt="x")), "r")
    assert plain.token_sparse_prefill is None  # the server's default
    with pytest.raises(ApiError) as err:
        parse_completion(json_body(prompt="x", token_sparse_prefill="yes"))
    assert err.value.status == 400
