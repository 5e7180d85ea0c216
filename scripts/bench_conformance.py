"""Structured outputs' conformance per grammar engine, on JSON schemas with valid and invalid
instances (JSONSchemaBench's MaskBench layout: one ``*.json`` per schema), and what a
random-weights model makes of the same schemas end to end.

Part 1 needs no model: each engine compiles every schema against the checkpoint's
tokenizer, and every instance is fed token by token through the worker's own mask path
(``services/bench/conformance.py``): valid instances must reach a stop token (else
over-constraining), invalid ones must be refused before it (else under-constraining).
Part 2 (``--engine-requests N``) runs the in-process engine on the checkpoint's random
weights, one request per schema the engine compiles (up to N), and checks that every
output that finishes parses with a strict JSON parser and validates (``jsonschema``).

    .venv/bin/python scripts/bench_conformance.py DATA_DIR --engine-requests 400

prints markdown tables (``docs/benchmarks/structured_outputs.md``); ``--json PATH`` writes
every outcome.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jsonschema

from messages.api import FinishedEvent
from messages.errors import RequestError
from messages.sampling import SamplingParams, StructuredOutput, StructuredOutputsBackend
from services.bench.conformance import CaseResult, ConformanceRun, SchemaCase, load_cases
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.structured.grammar import check_structured_output
from services.common.tokenizer import TextCodec
from services.worker.model.toy import ensure_checkpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", type=Path, help="a folder of MaskBench-style *.json cases")
    p.add_argument("--checkpoint", default=None, help="default: the toy random checkpoint")
    p.add_argument(
        "--backend",
        action="append",
        choices=[b.value for b in StructuredOutputsBackend],
        help="repeatable (default: every engine)",
    )
    p.add_argument("--any-whitespace", action="store_true", help="JSON with whitespace runs")
    p.add_argument("--engine-requests", type=int, default=0, metavar="N")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write every outcome here")
    args = p.parse_args()
    checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_checkpoint(None, "toy")
    codec = TextCodec.from_checkpoint(checkpoint)
    if codec is None:
        raise SystemExit(f"{checkpoint} has no tokenizer.json")
    limits = load_model_limits(checkpoint)
    cases = load_cases(args.data)
    backends = [StructuredOutputsBackend(b) for b in args.backend or StructuredOutputsBackend]
    whitespace = "whitespace runs <= 16" if args.any_whitespace else "compact"
    num_valid = sum(i.valid for c in cases for i in c.instances)
    print(
        f"{len(cases)} schemas, {num_valid} valid and "
        f"{sum(len(c.instances) for c in cases) - num_valid} invalid instances; checkpoint "
        f"{checkpoint.name} (vocabulary {limits.vocab_size}); JSON {whitespace}; "
        f"git {_git_commit()}\n"
    )
    results: dict[StructuredOutputsBackend, list[CaseResult]] = {}
    for backend in backends:
        run = ConformanceRun(
            codec, limits.vocab_size, list(limits.eos_token_ids), backend, args.any_whitespace
        )
        run.warm_up()
        start = time.perf_counter()
        results[backend] = [run.run_case(case) for case in cases]
        run.close()
        print(f"{backend}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print_summary(results)
    print_by_feature(results)
    print_failures(results)
    print_refusals(results)
    outcomes: dict[str, object] = {"conformance": _outcomes(results)}
    if args.engine_requests:
        outcomes["engine"] = run_engine(args, checkpoint, codec, cases, backends)
    if args.json is not None:
        args.json.write_text(json.dumps(outcomes, indent=1, ensure_ascii=False))
    return 0


# ---------------------------------------------------------------------- part 1: tables
def print_summary(results: dict[StructuredOutputsBackend, list[CaseResult]]) -> None:
    print(
        "| engine | schemas compiled | refused (their valid / invalid instances, not run) "
        "| valid accepted | over-constraining "
        "| invalid refused | under-constraining | raw control character accepted "
        "| compile ms p50 / p99 / max | mask us per token p50 / p99 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for backend, case_results in results.items():
        compiled = [r for r in case_results if r.refusal is None]
        refused = [r.case for r in case_results if r.refusal is not None]
        refused_valid = sum(i.valid for case in refused for i in case.instances)
        refused_invalid = sum(not i.valid for case in refused for i in case.instances)
        valid = [run for r in compiled for run in r.valid]
        invalid = [run for r in compiled for run in r.invalid]
        probes = [run for r in compiled for run in r.probes]
        over = sum(not run.accepted for run in valid)
        under = sum(run.accepted for run in invalid)
        compile_ms = [1e3 * r.compile_seconds for r in compiled]
        mask_us = [
            1e6 * s for r in compiled for run in (*r.valid, *r.invalid) for s in run.mask_seconds
        ]
        print(
            f"| {backend} | {len(compiled)} / {len(case_results)} "
            f"| {len(refused)} ({refused_valid} / {refused_invalid}) "
            f"| {len(valid) - over} / {len(valid)} | **{over}** ({_pct(over, len(valid))}) "
            f"| {len(invalid) - under} / {len(invalid)} | **{under}** "
            f"| {sum(run.accepted for run in probes)} / {len(probes)} "
            f"| {_pctile(compile_ms, 50):.1f} / {_pctile(compile_ms, 99):.1f} / "
            f"{max(compile_ms, default=0):.0f} "
            f"| {_pctile(mask_us, 50):.0f} / {_pctile(mask_us, 99):.0f} |"
        )
    print()


def print_by_feature(results: dict[StructuredOutputsBackend, list[CaseResult]]) -> None:
    """Per feature (a schema counts under each of its features): schemas compiled, and
    the over- and under-constraining instances of schemas with it. Features with nothing
    to report for any engine are left out."""
    features = sorted({f for rs in results.values() for r in rs for f in r.case.features})
    header = "| feature | schemas |" + "".join(f" {b}: compiled / over / under |" for b in results)
    print(header)
    print("|---|---|" + "---|" * len(results))
    for feature in features:
        cells, notable = [], False
        for case_results in results.values():
            with_it = [r for r in case_results if feature in r.case.features]
            compiled = [r for r in with_it if r.refusal is None]
            over = sum(len(r.over) for r in compiled)
            under = sum(len(r.under) for r in compiled)
            notable |= over > 0 or under > 0 or len(compiled) < len(with_it)
            cells.append(f" {len(compiled)} / {over} / {under} |")
        if notable:
            total = sum(feature in r.case.features for r in next(iter(results.values())))
            print(f"| {feature} | {total} |" + "".join(cells))
    print()


def print_failures(results: dict[StructuredOutputsBackend, list[CaseResult]]) -> None:
    rows = []
    for backend, case_results in results.items():
        for r in case_results:
            for kind, runs in (("over", r.over), ("under", r.under)):
                for run in runs:
                    where = f"token {run.refused_at} of {run.num_tokens}" if kind == "over" else ""
                    text = run.text[:70].replace("|", "\\|")
                    rows.append(
                        f"| {backend} | {kind} | {r.case.name} | {', '.join(r.case.features)} "
                        f"| {where} | `{text}` |"
                    )
    if rows:
        print("| engine | error | schema | its features | refused at | instance (start) |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
        print()


def print_refusals(results: dict[StructuredOutputsBackend, list[CaseResult]]) -> None:
    print("| engine | why a schema was refused (a 400 naming it) | schemas |")
    print("|---|---|---|")
    for backend, case_results in results.items():
        reasons = collections.Counter(
            _reason(r.refusal) for r in case_results if r.refusal is not None
        )
        for reason, count in reasons.most_common():
            print(f"| {backend} | {reason} | {count} |")
    print()


def _reason(message: str) -> str:
    text = message.split("does not compile", 1)[-1].lstrip(": ")
    text = re.sub(r"\d+", "N", text)
    text = text.split(" while processing", 1)[0]
    return text[:100].replace("|", "\\|")


def _outcomes(results: dict[StructuredOutputsBackend, list[CaseResult]]) -> dict:
    return {
        backend.value: [
            {
                "schema": r.case.name,
                "features": list(r.case.features),
                "refusal": r.refusal,
                "compile_ms": 1e3 * r.compile_seconds,
                "over": [run.text for run in r.over],
                "under": [run.text for run in r.under],
                "probes_accepted": [run.text for run in r.probes_accepted],
            }
            for r in case_results
        ]
        for backend, case_results in results.items()
    }


# ---------------------------------------------------------------------- part 2: the engine
def run_engine(
    args: argparse.Namespace,
    checkpoint: Path,
    codec: TextCodec,
    cases: list[SchemaCase],
    backends: list[StructuredOutputsBackend],
) -> dict:
    import torch

    from services.engine.engine import LLMEngine
    from services.worker.model.ouro import OuroModel

    torch.set_num_threads(1)
    model = OuroModel.from_checkpoint(checkpoint)
    print(
        f"End to end: {checkpoint.name}'s weights, temperature {args.temperature}, "
        f"top_p {args.top_p}, "
        f"max_tokens {args.max_tokens}, 16 random prompt tokens per request, one request "
        "per schema the engine compiles (seeded shuffle).\n"
    )
    print(
        "| engine | JSON | requests | finished (stop) | finished and valid | cut by max_tokens "
        "| cut inside a string | its open string's characters p50 / min "
        "| median tokens | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    out: dict[str, object] = {}
    for backend in backends:
        for any_whitespace in (False, True):
            rng = random.Random(args.seed)
            order = list(cases)
            rng.shuffle(order)
            chosen, params = [], []
            for case in order:
                constraint = StructuredOutput(
                    kind="json_schema",
                    spec=case.schema,
                    backend=backend,
                    any_whitespace=any_whitespace,
                )
                try:
                    check_structured_output(constraint)
                except RequestError:
                    continue
                chosen.append(case)
                params.append(
                    SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                        top_p=args.top_p,
                        seed=args.seed + len(params),
                        structured_output=constraint,
                    )
                )
                if len(chosen) == args.engine_requests:
                    break
            prompts = [[rng.randrange(1, codec.vocab_size - 2) for _ in range(16)] for _ in chosen]
            config = SchedulerConfig(
                max_num_seqs=64, num_blocks=16384, structured_outputs_backend=backend
            )
            engine = LLMEngine(model, config, codec=codec)
            start = time.perf_counter()
            finished = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            engine.grammars.close() if engine.grammars is not None else None
            label = "whitespace <= 16" if any_whitespace else "compact"
            out[f"{backend}/{label}"] = summary = _engine_summary(codec, chosen, finished)
            print(
                f"| {backend} | {label} | {len(chosen)} | {summary['stop']} "
                f"| **{summary['valid']}** / {summary['stop']} "
                f"| {summary['length']} ({_pct(summary['length'], len(chosen))}) "
                f"| {summary['cut_in_string']} | {summary['open_string_chars']} "
                f"| {summary['median_tokens']} | {seconds:.0f} |"
            )
    print()
    return out


def _engine_summary(codec: TextCodec, cases: list[SchemaCase], finished: list) -> dict:
    counts: collections.Counter[str] = collections.Counter()
    lengths, invalid, open_strings = [], [], []
    for case, event in zip(cases, finished, strict=True):
        if not isinstance(event, FinishedEvent):
            counts["error"] += 1
            invalid.append({"schema": case.name, "error": str(event)[:300]})
            continue
        lengths.append(len(event.token_ids))
        text = codec.decode(event.token_ids)
        counts[event.finish_reason] += 1
        if event.finish_reason == "length":
            # quotes outside escapes: an odd count leaves the text inside a string, which
            # has run since the last of them
            unescaped = re.sub(r"\\.", "__", text)
            if unescaped.count('"') % 2:
                counts["cut_in_string"] += 1
                open_strings.append(len(unescaped) - unescaped.rindex('"') - 1)
            continue
        try:
            schema = json.loads(case.schema)
            validator = jsonschema.validators.validator_for(schema)
            # the formats jsonschema can check are checked too (an engine enforces them)
            validator(schema, format_checker=validator.FORMAT_CHECKER).validate(json.loads(text))
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append({"schema": case.name, "text": text, "why": str(exc)[:300]})
    return {
        "stop": counts["stop"],
        "valid": counts["valid"],
        "length": counts["length"],
        "error": counts["error"],
        "cut_in_string": counts["cut_in_string"],
        "open_string_chars": (
            f"{int(statistics.median(open_strings))} / {min(open_strings)}" if open_strings else "-"
        ),
        "median_tokens": int(statistics.median(lengths)) if lengths else 0,
        "invalid": invalid,
    }


# ---------------------------------------------------------------------- helpers
def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _pctile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
