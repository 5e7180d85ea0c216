"""Tool calling's conformance and cost: the function-argument schemas of JSONSchemaBench
(its Glaive and BFCL subsets) as tools, end to end on a checkpoint, and the decoding speed
with tools against free-form text.

Each Glaive file is one function (named by its file) whose ``parameters`` is the schema;
each BFCL file is one or several functions (``{"<name>": <arguments>}``, or an ``anyOf`` of
such objects). Part 1: every function schema is compiled by the grammar engine (accepted or
refused, and why). Part 2: for every tool set whose functions all compile, the in-process
engine answers a chat rendered with the checkpoint's own template (``tools`` passed as
transformers passes them), once with ``tool_choice: required`` and once naming the first
function, parallel calls allowed or not (``--parallel``); each answer is read back with the
gateway's parser, and a finished one (``stop``) must hold calls of offered functions whose
arguments parse and validate (``jsonschema``). Part 3 (``--speed-rounds N``): output
tokens/s of the same requests free (``ignore_eos``) and with a tools format whose arguments
never end within ``--max-tokens`` (as ``bench_structured.py`` does), and with ``auto`` (free
text under the trigger's lexer), rounds alternating A B C; per CPU second of this process.

    .venv/bin/python scripts/bench_tools.py                      # the toy checkpoint
    .venv/bin/python scripts/bench_tools.py --checkpoint DIR --speed-rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from messages.api import FinishedEvent
from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.structured.grammar import check_structured_output
from services.common.structured.tool_format import FunctionSpec, ToolCallSpec, ToolMode
from services.common.tokenizer import TextCodec
from services.common.tool_template import chat_for_template, template_tools
from services.engine.engine import LLMEngine
from services.gateway.constrained.tool_parser import ToolCallParser
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import ensure_checkpoint

# the workspace's full sample, else the repository's few files (tests/data)
_SHARED = Path(__file__).parents[1] / ".." / "shared" / "data" / "jsonschemabench"
_IN_REPO = Path(__file__).parents[1] / "tests" / "data" / "jsonschemabench"
DEFAULT_DATA = _SHARED if _SHARED.is_dir() else _IN_REPO
_GLAIVE = re.compile(r"^Glaiveai2K---(.+)_[0-9a-f]{8}\.json$")


def tool_sets(data: Path) -> list[tuple[str, list[tuple[str, Any]]]]:
    """(file name, [(function name, parameters schema)]) of every Glaive and BFCL file."""
    found = []
    for path in sorted(data.glob("*.json")):
        schema = json.loads(path.read_text())["schema"]
        glaive = _GLAIVE.match(path.name)
        if glaive:
            found.append((path.name, [(glaive.group(1), schema)]))
        elif path.name.startswith("BFCL_"):
            options = schema.get("anyOf", [schema])
            functions = [(n, p) for o in options for n, p in o["properties"].items()]
            found.append((path.name, functions))
    return found


def spec_of(functions: list[tuple[str, Any]], mode: ToolMode, parallel: bool) -> ToolCallSpec:
    return ToolCallSpec(
        functions=[FunctionSpec(name=n, parameters=json.dumps(p)) for n, p in functions],
        mode=mode,
        parallel=parallel,
    )


def tools_of(functions: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": n, "description": n, "parameters": p}}
        for n, p in functions
    ]


def compile_all(sets: list[tuple[str, list[tuple[str, Any]]]]) -> dict[str, str | None]:
    """Part 1: each function schema, by ``file:name``: None (compiles) or the refusal."""
    out: dict[str, str | None] = {}
    for file, functions in sets:
        for name, parameters in functions:
            try:
                check_structured_output(spec_of([(name, parameters)], ToolMode.REQUIRED, True)
                                        .constraint())  # fmt: skip
                out[f"{file}:{name}"] = None
            except RequestError as exc:
                out[f"{file}:{name}"] = exc.message
    return out


def check_answer(text: str, spec: ToolCallSpec, schemas: dict[str, Any]) -> str | None:
    """Why a finished answer's calls are not well formed (None: they are)."""
    parser = ToolCallParser(spec.format, "bench")
    parser.push(text)
    parser.flush()
    if not parser.calls:
        return "no call"
    if len(parser.calls) > 1 and not spec.parallel:
        return "several calls"
    offered = {f.name for f in spec.functions}
    for call in parser.calls:
        if not call.complete or call.name not in offered:
            return f"call {call.name!r} incomplete or not offered"
        try:
            arguments = json.loads(call.arguments)
        except ValueError as exc:
            return f"arguments do not parse: {exc}"
        schema = schemas[call.name]
        errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments))
        if errors:
            return f"arguments do not validate: {errors[0].message[:120]}"
    return None


def run_engine(
    engine: LLMEngine,
    codec: TextCodec,
    sets: list[tuple[str, list[tuple[str, Any]]]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Part 2: one request per tool set and mode; the finished answers checked."""
    cases, prompts, params = [], [], []
    for file, functions in sets:
        messages = [{"role": "user", "content": f"Please call {functions[0][0]}."}]
        rendered, tools = chat_for_template(codec, messages, tools_of(functions))
        prompt = codec.encode_chat(rendered, True, tools)
        for mode, chosen in (("required", functions), ("named", functions[:1])):
            spec = spec_of(chosen, ToolMode.REQUIRED, args.parallel)
            cases.append((file, mode, spec, dict(chosen)))
            prompts.append(prompt)
            constraint = spec.constraint()
            sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
            params.append(
                SamplingParams(**sampling, seed=len(params), structured_output=constraint)
            )
    start = time.perf_counter()
    finished = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    outcome: dict[str, Any] = {"requests": len(cases), "finished": 0, "valid": 0, "length": 0}
    failures = []
    for (file, mode, spec, schemas), done in zip(cases, finished, strict=True):
        if not isinstance(done, FinishedEvent):
            failures.append((file, mode, f"error: {done.message}"))
            continue
        if done.finish_reason != "stop":
            outcome["length"] += 1
            continue
        outcome["finished"] += 1
        problem = check_answer(codec.decode(done.token_ids), spec, schemas)
        if problem is None:
            outcome["valid"] += 1
        else:
            failures.append((file, mode, problem))
    outcome["failures"] = failures
    outcome["seconds"] = round(seconds, 1)
    return outcome


def run_speed(engine: LLMEngine, codec: TextCodec, args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: output tokens per CPU second, free against tools (required and auto)."""
    endless = {"type": "object", "properties": {"values": {"type": "array",
               "items": {"type": "integer", "minimum": 0, "maximum": 999},
               "minItems": args.max_tokens}}, "required": ["values"]}  # fmt: skip
    functions = [("record_values", endless), ("other", {"type": "object"})]
    messages = [{"role": "user", "content": "Record some values."}]
    rendered, tools = chat_for_template(codec, messages, tools_of(functions))
    prompts = [codec.encode_chat(rendered, True, tools)] * args.speed_requests
    common = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    required = spec_of(functions, ToolMode.REQUIRED, False).constraint()
    # auto: text under the trigger's lexer (the model may open a call, then held to it)
    auto = spec_of(functions, ToolMode.AUTO, False).constraint()
    seeds = range(len(prompts))
    arms = {
        "free": [SamplingParams(**common, seed=i, ignore_eos=True) for i in seeds],
        "tools required": [
            SamplingParams(**common, seed=i, structured_output=required) for i in seeds
        ],
        "tools auto": [SamplingParams(**common, seed=i, structured_output=auto) for i in seeds],
    }
    for params in arms.values():  # warm-up: the engine's import, the compile
        engine.generate(prompts, params)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(args.speed_rounds):
        for name, params in arms.items():
            cpu = time.process_time()
            finished = engine.generate(prompts, params)
            cpu = time.process_time() - cpu
            tokens = sum(len(f.token_ids) for f in finished if isinstance(f, FinishedEvent))
            rates[name].append(tokens / cpu)
            print(f"round {round_ + 1} {name}: {tokens / cpu:.0f} tok/CPU s", file=sys.stderr)
    free = statistics.median(rates["free"])
    medians = {name: statistics.median(v) for name, v in rates.items()}
    return {name: {"median": round(m), "ratio": round(m / free, 3)} for name, m in medians.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="default: the toy random checkpoint")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="JSONSchemaBench files")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--parallel", action="store_true", help="allow several calls an answer")
    p.add_argument("--limit", type=int, default=None, help="run only the first N tool sets")
    p.add_argument("--speed-rounds", type=int, default=0, metavar="N")
    p.add_argument("--speed-requests", type=int, default=16)
    p.add_argument("--json", type=Path, default=None, help="write every outcome here")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_checkpoint(None, "toy")
    codec = TextCodec.from_checkpoint(checkpoint)
    if codec is None:
        raise SystemExit(f"{checkpoint} has no tokenizer.json")
    template = template_tools(codec)
    print(f"checkpoint {checkpoint}; tool format: {template.description}")
    if template.format is None:
        raise SystemExit("this checkpoint's tool format is not one rlt reads")
    sets = tool_sets(args.data.resolve())
    compiled = compile_all(sets)
    refused = {k: v for k, v in compiled.items() if v is not None}
    print(f"\n{len(sets)} tool sets, {len(compiled)} function schemas: "
          f"{len(compiled) - len(refused)} compile, {len(refused)} refused")  # fmt: skip
    for key, why in refused.items():
        print(f"  refused {key}: {why}")
    runnable = [(f, fs) for f, fs in sets if all(compiled[f"{f}:{n}"] is None for n, _ in fs)]
    runnable = runnable[: args.limit]
    model = OuroModel.from_checkpoint(checkpoint)
    config = SchedulerConfig(max_num_seqs=32, num_blocks=16384)
    engine = LLMEngine(model, config, codec=codec)
    outcomes: dict[str, Any] = {"compiled": compiled}
    engine_run = outcomes["engine"] = run_engine(engine, codec, runnable, args)
    finished, valid = engine_run["finished"], engine_run["valid"]
    share = f"{100 * valid / finished:.1f}%" if finished else "n/a"
    print(
        f"\nengine: {engine_run['requests']} requests (required and named, parallel "
        f"{'on' if args.parallel else 'off'}, {args.max_tokens} tokens at most, temperature "
        f"{args.temperature}): {finished} finished, {valid} with valid calls ({share}), "
        f"{engine_run['length']} cut by max_tokens; {engine_run['seconds']} s"
    )
    for file, mode, problem in engine_run["failures"]:
        print(f"  {file} ({mode}): {problem}")
    if args.speed_rounds:
        speed = outcomes["speed"] = run_speed(engine, codec, args)
        print(f"\n| arm | output tok per CPU s (median of {args.speed_rounds}) | vs free |")
        print("|---|---|---|")
        for name, figures in speed.items():
            print(f"| {name} | {figures['median']} | {figures['ratio']:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(outcomes, indent=1))
    return 0 if finished == valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
