"""Helpers shared by test modules (no test module imports another)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema
import torch

from messages.api import StreamEvent
from messages.batch import BatchResult, RowKind, RowResult
from messages.internal import WorkerBatch, WorkerResult
from messages.sampling import SamplingParams
from services.common.sampling import gumbel_noise, sample_token
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.driver.step_output import StepOutput
from services.worker.runner import ModelRunner


def run_on(runner: ModelRunner, wb: WorkerBatch) -> WorkerResult:
    """What a worker service answers for ``wb``: the batch run on ``runner``."""
    return WorkerResult(epoch=wb.epoch, result=runner.execute(wb.batch), worker_id=wb.worker_id)


def fake_result(batch: ScheduledBatch, token: int = 7) -> BatchResult:
    """A worker stand-in: decode rows exit after their first loop, coda rows sample `token`."""
    rows = []
    for i, task in enumerate(batch.tasks):
        if task.kind == RowKind.DECODE:
            rows.append(
                RowResult(
                    row_index=i,
                    exited=True,
                    exit_loops=task.depth + 1,
                    token_id=token,
                    remaining=0.5,
                )
            )
        else:
            rows.append(RowResult(row_index=i, token_id=token if task.compute_logits else -1))
    return BatchResult(seq=batch.seq, rows=rows)


def relayed_events(out: StepOutput) -> list[StreamEvent]:
    """The stream events a scheduler driver's output relays to admission (a resync, which
    carries the outputs so far, has none)."""
    return [r.item.event for r in out.relays if r.item.event is not None]


# ---------------------------------------------------------------------- structured outputs
# Formats whose every output is bounded (a random model ends them within max_tokens), one
# of each kind but json_object (unbounded: tests accept a valid prefix cut by length).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
EMAIL_REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so", "déjà vu"]
SUM_GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]{1,3}'
SUM_REGEX = r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)"
FORMATS: dict[str, tuple[str, str]] = {
    "json_schema": ("json_schema", json.dumps(PERSON_SCHEMA)),
    "regex": ("regex", EMAIL_REGEX),
    "choice": ("choice", json.dumps(CHOICES)),
    "grammar": ("grammar", SUM_GRAMMAR),
}


def assert_follows(kind: str, spec: str, text: str) -> None:
    """``text`` is a complete output of the format (kind, spec) (checked without xgrammar)."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in json.loads(spec), text
    elif kind == "grammar":
        assert spec == SUM_GRAMMAR and re.fullmatch(SUM_REGEX, text), text
    else:
        raise AssertionError(f"unknown kind {kind}")


class MaskedSampler:
    """An oracle sampler (``SerialOracle.generate(sampler=...)``) that applies a grammar's
    mask as the engine must: its own matcher, the mask's bits unpacked here (not the
    worker's kernel), then greedy argmax or the counter-based sampler. ``gaps[i]`` is the
    margin token i was chosen by (the top two allowed scores), so a comparison can stop at
    a near-tie."""

    def __init__(self, compiled: Any, vocab_size: int, params: SamplingParams) -> None:
        self.matcher = compiled.matcher()
        self.bitmask = torch.zeros((1, -(-vocab_size // 32)), dtype=torch.int32)
        self.params = params
        self.gaps: list[float] = []

    def __call__(self, logits: torch.Tensor, index: int) -> int:
        p = self.params
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.clone().float()
        masked[~allowed_tokens(self.bitmask[0], masked.numel())] = -math.inf
        if p.temperature:
            assert p.seed is not None
            token = sample_token(
                masked,
                temperature=p.temperature,
                top_k=p.top_k or 0,
                top_p=1.0 if p.top_p is None else p.top_p,
                seed=p.seed,
                output_index=index,
            )
            seed, at = torch.tensor([p.seed]), torch.tensor([index])
            scores = masked / p.temperature + gumbel_noise(seed, at, masked.numel())[0]
        else:
            token = int(torch.argmax(masked))
            scores = masked
        top = torch.topk(scores, 2).values.tolist()
        self.gaps.append(top[0] - top[1] if math.isfinite(top[1]) else math.inf)
        assert self.matcher.accept_token(token), (index, token)
        return token


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A grammar's int32 bitmask as one bool per token id (bit ``i % 32`` of word
    ``i // 32``)."""
    bits = (words.long().unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()
