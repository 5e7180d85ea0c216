"""The soak's output check (``scripts/soak_verify.py``): an output equal to the in-process
engine's (or a prefix of it, when aborted) passes; any other is named with its first
differing token and the oracle's gaps there, and counts as altered unless a near-tie
explains it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from messages.api import FinishedEvent, TokenEvent
from scripts.soak import ENGINE_ARGS
from scripts.soak_verify import params_of, stream_problem, verify_outputs
from services.cli import build_parser
from services.common.flags import scheduler_config_from_args
from services.engine.engine import LLMEngine
from services.oracle import near_tie

pytestmark = pytest.mark.oracle

BODIES = [
    {"request_id": "greedy", "prompt_token_ids": [1, 2, 3, 40, 41], "max_tokens": 12,
     "temperature": 0.0, "seed": 3, "min_loops": 1, "exit_threshold": 0.7, "ignore_eos": True},
    {"request_id": "sampled", "prompt_token_ids": [7, 300, 9], "max_tokens": 10,
     "temperature": 0.8, "seed": 5, "min_loops": 2, "exit_threshold": 1.0, "ignore_eos": True},
]  # fmt: skip


@dataclass
class Tally:
    verified: int = 0
    altered: int = 0
    near_ties: int = 0
    divergences: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def engine_outputs(toy_checkpoint: Path) -> list[FinishedEvent]:
    config = scheduler_config_from_args(
        build_parser().parse_args(["service", "worker", *ENGINE_ARGS])
    )
    engine = LLMEngine.from_checkpoint(toy_checkpoint, config)
    return engine.generate([b["prompt_token_ids"] for b in BODIES], [params_of(b) for b in BODIES])


def _check(checkpoint: Path, outputs: list[FinishedEvent]) -> Tally:
    tally = Tally()
    verify_outputs(list(zip(outputs, BODIES, strict=True)), checkpoint, ENGINE_ARGS, tally)
    return tally


def _with(out: FinishedEvent, **changes: Any) -> FinishedEvent:
    return msgspec.structs.replace(out, **changes)


def test_equal_outputs_and_aborted_prefixes_pass(
    toy_checkpoint: Path, engine_outputs: list[FinishedEvent]
) -> None:
    tally = _check(toy_checkpoint, engine_outputs)
    assert (tally.verified, tally.altered, tally.near_ties, tally.divergences) == (2, 0, 0, [])
    greedy, sampled = engine_outputs
    aborted = _with(
        sampled, finish_reason="abort", token_ids=sampled.token_ids[:4],
        exit_depths=sampled.exit_depths[:4],
    )  # fmt: skip
    tally = _check(toy_checkpoint, [greedy, aborted])
    assert (tally.verified, tally.altered) == (2, 0)


def test_an_altered_output_is_named_with_the_gaps_where_it_differs(
    toy_checkpoint: Path, engine_outputs: list[FinishedEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy, sampled = engine_outputs
    i = 5
    tokens = list(sampled.token_ids)
    tokens[i] = (tokens[i] + 1) % 512
    tally = _check(toy_checkpoint, [greedy, _with(sampled, token_ids=tokens)])
    assert (tally.verified, tally.altered, tally.near_ties) == (2, 1, 0)
    [record] = tally.divergences
    assert record["request_id"] == "sampled" and record["params"]["temperature"] == 0.8
    assert record["prompt_token_ids"] == BODIES[1]["prompt_token_ids"]
    assert record["index"] == i
    assert record["tokens"] == {"services": tokens[i], "engine": sampled.token_ids[i]}
    depth = sampled.exit_depths[i]
    assert record["exit_depths"] == {"services": depth, "engine": depth}
    assert record["near_tie"] is None and record["note"] == ""
    for gap in ("top2_gap", "draw_gap", "pair_gap"):
        assert isinstance(record[gap], float) and record[gap] >= 0, record
    assert record["exit_margin"] == "inf"  # threshold 1.0: the exit rule never decided

    # at a gap the rule calls close, the same difference is a near-tie, counted apart
    monkeypatch.setattr(near_tie, "TIE_EPS", record["pair_gap"] * 1.01)
    tally = _check(toy_checkpoint, [greedy, _with(sampled, token_ids=tokens)])
    assert (tally.altered, tally.near_ties) == (0, 1)
    assert tally.divergences[0]["near_tie"].startswith("top-2 gap")


def test_a_truncated_or_prolonged_output_is_altered(
    toy_checkpoint: Path, engine_outputs: list[FinishedEvent]
) -> None:
    greedy, sampled = engine_outputs
    short = _with(greedy, token_ids=greedy.token_ids[:-1], exit_depths=greedy.exit_depths[:-1])
    tally = _check(toy_checkpoint, [short, sampled])
    assert tally.altered == 1 and "ended" in tally.divergences[0]["note"]
    assert tally.divergences[0]["tokens"] == {"services": None, "engine": greedy.token_ids[-1]}
    longer = _with(
        sampled, finish_reason="abort", token_ids=[*sampled.token_ids, 1],
        exit_depths=[*sampled.exit_depths, 4],
    )  # fmt: skip
    assert _check(toy_checkpoint, [greedy, longer]).altered == 1


def test_a_stream_with_a_foreign_or_repeated_event_is_named() -> None:
    def token(rid: str, index: int) -> TokenEvent:
        return TokenEvent(request_id=rid, index=index, token_id=1, exit_depth=4, text="")

    assert stream_problem([token("a", 0), token("a", 1)], "a") is None
    assert "foreign" in (stream_problem([token("a", 0), token("b", 1)], "a") or "")
    assert "order" in (stream_problem([token("a", 0), token("a", 0)], "a") or "")
    assert "order" in (stream_problem([token("a", 1), token("a", 0)], "a") or "")
