"""Helpers shared by test modules (no test module imports another)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from messages.api import FinishedEvent, StreamEvent
from messages.batch import BatchResult, RowKind, RowResult
from messages.internal import WorkerBatch, WorkerResult
from messages.sampling import SamplingParams, StructuredOutput
from services.common.sampling import gumbel_noise, sample_token
from services.common.tokenizer import TextCodec
from services.oracle.near_tie import compare_with_oracle
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.driver.step_output import StepOutput
from services.worker.runner import ModelRunner
from services.worker.sampling.grammar import GrammarBook


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


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that launch work (a view that aliases its input launches
    nothing and is not counted), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view or not _aliases(out, args[0]):
            # a "view" that made new memory (``.to(dtype)`` under inference mode) copied
            self.ops[str(func)] += 1
        return out


def _aliases(out: object, source: object) -> bool:
    if not isinstance(out, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


# ---------------------------------------------------------------------- structured outputs
TOY_VOCAB = 512  # the toy model's


def structured_constraint(name: str, any_whitespace: bool = False) -> StructuredOutput:
    if name == "json_object":
        return StructuredOutput(kind="json_object", any_whitespace=any_whitespace)
    kind, spec = FORMATS[name]
    return StructuredOutput(
        kind=kind, spec=spec, any_whitespace=any_whitespace and kind == "json_schema"
    )


def structured_workload(
    count: int, seed: int, json_max_tokens: int = 512, any_whitespace: bool | None = None
) -> list[tuple[str, list[int], SamplingParams, str]]:
    """Random prompts, each with a format (every kind in turn), greedy and sampled, some with
    early exit: (request id, prompt, params, format name). JSON is compact, or takes
    whitespace runs in every other round of kinds (``any_whitespace`` None) or always."""
    rng = random.Random(seed)
    names = [*FORMATS, "json_object"]
    out = []
    for i in range(count):
        name = names[i % len(names)]
        spaced = (i // len(names)) % 2 == 1 if any_whitespace is None else any_whitespace
        prompt = [rng.randrange(1, 509) for _ in range(rng.randrange(2, 24))]
        params = SamplingParams(
            max_tokens=json_max_tokens if name == "json_schema" else 64,
            temperature=0.0 if i % 2 == 0 else 1.0,
            seed=1000 + i,
            min_loops=1,
            exit_threshold=0.7 if i % 3 == 0 else 1.0,
            structured_output=structured_constraint(name, spaced),
        )
        out.append((f"r{i}", prompt, params, name))
    return out


def check_formats(finished, workload, codec: TextCodec, book: GrammarBook) -> None:
    """Every output follows its format: complete ones validate, and json_object outputs cut
    by max_tokens are prefixes the grammar accepts."""
    for rid, _, params, name in workload:
        done = finished[rid]
        text = codec.decode(done.token_ids)
        constraint = params.structured_output
        assert constraint is not None
        if name == "json_object" and done.finish_reason == "length":
            matcher = book.compile(constraint).result().matcher()
            assert all(matcher.accept_token(t) for t in done.token_ids), (rid, text)
            continue
        assert done.finish_reason == "stop", (rid, name, done.finish_reason, text)
        assert_follows(constraint.kind, constraint.spec, text)


def masked_oracle_run(oracle, book: GrammarBook, prompt: list[int], params: SamplingParams):
    assert params.structured_output is not None
    sampler = MaskedSampler(book.compile(params.structured_output).result(), TOY_VOCAB, params)
    expected = oracle.generate(
        prompt,
        max_tokens=params.max_tokens,
        min_loops=params.min_loops,
        exit_threshold=params.exit_threshold,
        sampler=sampler,
    )
    return expected, sampler.gaps


def assert_equals_masked_oracle(
    done: FinishedEvent, expected, gaps: list[float], label: str
) -> int:
    """Tokens and exit depths equal the oracle's up to its first near-tie (of the masked
    scores, or of the exit rule); returns how many were compared."""
    comparison = compare_with_oracle(done, expected, gaps)
    assert comparison.mismatch is None, (label, comparison.mismatch, done.token_ids, expected)
    return comparison.compared


def assert_passes_under_triton_interpreter(module: str, *args: str) -> None:
    """Runs ``python -m module args`` with ``TRITON_INTERPRET=1`` in a fresh process (the
    interpreter is chosen when triton decorates a kernel): its own checks must pass."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout}\n{proc.stderr[-4000:]}"
