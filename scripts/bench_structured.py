"""Structured outputs' cost: the in-process engine's output tokens/s with a JSON schema
against the same requests without one, side by side.

All arms run the same prompts to exactly ``--max-tokens`` tokens each, so they do the same
model work and differ only by the grammar: a schema's arm (one per grammar engine,
``--backend``) asks for an array of at least ``--max-tokens`` integers in compact JSON (it
is always cut by max_tokens, never ended early by the grammar), and the free arm sets
``ignore_eos``. Every schema token is masked: a mask filled on the host per row and token,
one more copy per pass, the mask applied before sampling, and the matcher advanced. Arms
alternate A B C A B C for ``--repeats`` rounds after one warm-up round (the engines'
imports and the first compile); each prints tokens/s, per wall second and per CPU second
of this process, and the table gives for each the median [min-max] per arm, the ratio of
medians to the free arm's, and the median [min-max] of each round's own ratio (the runs of
a round are neighbours in time). On a shared machine, per CPU second is the steadier.

    .venv/bin/python scripts/bench_structured.py --size small --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from messages.api import FinishedEvent
from messages.sampling import SamplingParams, StructuredOutput, StructuredOutputsBackend
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import ensure_checkpoint


def schema(min_items: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "values": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": min_items,
            }
        },
        "required": ["values"],
        "additionalProperties": False,
    }


def run_arm(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, output tokens) of one run of every
    prompt. On a shared machine the CPU time is the steadier measure: the engine runs on
    one thread here, and other processes' load stretches the wall clock, not it."""
    start, cpu = time.perf_counter(), time.process_time()
    finished = engine.generate(prompts, params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(f.token_ids) for f in finished if isinstance(f, FinishedEvent))
    return seconds, cpu, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["toy", "small"])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        action="append",
        choices=[b.value for b in StructuredOutputsBackend],
        help="a schema arm per engine named (repeatable; default: every engine)",
    )
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    checkpoint = ensure_checkpoint(None, args.size)
    codec = TextCodec.from_checkpoint(checkpoint)
    model = OuroModel.from_checkpoint(checkpoint)
    config = SchedulerConfig(max_num_seqs=args.requests, num_blocks=8192)
    engine = LLMEngine(model, config, codec=codec)
    rng = random.Random(args.seed)
    vocab = model.cfg.vocab_size
    prompts = [
        [rng.randrange(1, vocab - 2) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    spec = json.dumps(schema(args.max_tokens))
    common = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    arms = {
        "free": [SamplingParams(**common, seed=i, ignore_eos=True) for i in range(len(prompts))]
    }
    for backend in args.backend or [b.value for b in StructuredOutputsBackend]:
        constraint = StructuredOutput(kind="json_schema", spec=spec, backend=backend)
        arms[f"json_schema {backend}"] = [
            SamplingParams(**common, seed=i, structured_output=constraint)
            for i in range(len(prompts))
        ]
    for name, params in arms.items():  # warm-up: imports, the compile, allocator
        run_arm(engine, prompts, params)
        print(f"warm-up {name} done", file=sys.stderr)
    rates: dict[str, dict[str, list[float]]] = {"wall": {}, "cpu": {}}
    for i in range(args.repeats):
        for name, params in arms.items():
            seconds, cpu, tokens = run_arm(engine, prompts, params)
            assert tokens == args.requests * args.max_tokens, (name, tokens)
            rates["wall"].setdefault(name, []).append(tokens / seconds)
            rates["cpu"].setdefault(name, []).append(tokens / cpu)
            print(
                f"round {i + 1}: {name}: {tokens / seconds:.0f} tok/s "
                f"({tokens / cpu:.0f} per CPU second)",
                file=sys.stderr,
            )
    print(
        f"| {args.size}, {args.requests} requests x {args.max_tokens} tokens, temperature "
        f"{args.temperature} | measure | output tok/s median [min-max] | ratio of medians "
        "| per-round ratio median [min-max] |"
    )
    print("|---|---|---|---|---|")
    for measure, by_arm in rates.items():
        free = by_arm["free"]
        for name, values in by_arm.items():
            median = statistics.median(values)
            paired = [v / f for v, f in zip(values, free, strict=True)]
            print(
                f"| {name} | {measure} | {median:.0f} [{min(values):.0f}-{max(values):.0f}] "
                f"| {median / statistics.median(free):.3f} "
                f"| {statistics.median(paired):.3f} [{min(paired):.3f}-{max(paired):.3f}] |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
