#!/usr/bin/env python3
"""One-command device check of the fused core pass on a lent GPU (H200), under 8 minutes.

    python3 scripts/device_check.py            # on the GPU machine: Ouro-1.4B shape, bf16
    python3 scripts/device_check.py --quick    # dry run on the CPU, toy checkpoint, seconds

Sections, each in its own child process with a time box (a hang, an OOM or a broken CUDA
context costs that section, never the report):

1. ``pass_time``: ms per decode core pass at fixed depth, 1/32/128 rows, graphs on and off.
2. ``decode``: decode tokens/s at concurrency 1/32/128, early exit off and on, graphs on.
3. ``hbm``: the HBM bound of each measured pass (core weights + KV read, from the sim's cost
   model) against the measured time.
4. ``oracle``: the engine in fp32 (toy and small checkpoints) against the serial oracle, eager
   and graphs, early exit included, stopping only at the oracle's own near-ties.
5. ``bf16``: greedy top-1 agreement of bf16 with fp32 on the 1.4B shape.

The report (markdown table + JSON) is rewritten after every row, so a run killed from
outside still leaves what it had.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from anywhere: import the repo's packages
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

if TYPE_CHECKING:  # the engine's imports stay lazy: the env row reports what is missing
    from messages.api import ErrorEvent, FinishedEvent
    from messages.sampling import SamplingParams
    from services.engine.engine import LLMEngine
    from services.oracle.serial import OracleResult
    from services.worker.model.ouro import OuroModel
    from services.worker.sim import SimCostModel
    from services.worker.static_decode import DecodeMode

COLUMNS = ("section", "config", "result", "detail")
TABLE_HEADER = "| " + " | ".join(COLUMNS) + " |"
SECTIONS = ("pass_time", "decode", "hbm", "oracle", "bf16")
CHILD_SECTIONS = ("pass_time", "decode", "oracle", "bf16")  # hbm is arithmetic, in the parent
# a comparison with the oracle may stop where the oracle itself is this close to a tie
TIE_EPS = 1e-5
CPU_NOTE = (
    "**CPU dry run: these are not GPU numbers.** Toy checkpoint and tiny counts on the CPU; "
    "graphs fall back to padded eager passes; the HBM bound is the H200's."
)


@dataclass(frozen=True)
class Plan:
    """Sizes of every section; --quick shrinks them all."""

    shape: str  # a CHECKPOINT_SIZES name, written in bf16 for sections 1, 2, 3 and 5
    rows: tuple[int, ...]
    warm_steps: int
    timed_steps: int
    concurrency: tuple[int, ...]
    prompt_len: int
    out_tokens: int
    oracle_sizes: tuple[str, ...]
    oracle_prompts: int
    oracle_tokens: int
    agree_prompts: int
    agree_tokens: int
    # hard time box of each child section, seconds: 400 s in all on the GPU, which leaves
    # the checkpoint write and start-up inside 8 minutes
    boxes: dict[str, float] = field(default_factory=dict)


FULL = Plan(
    shape="1.4b",
    rows=(1, 32, 128),
    warm_steps=12,
    timed_steps=96,
    concurrency=(1, 32, 128),
    prompt_len=16,
    out_tokens=64,
    oracle_sizes=("toy", "small"),
    oracle_prompts=8,
    oracle_tokens=24,
    agree_prompts=8,
    agree_tokens=32,
    boxes={"pass_time": 110, "decode": 100, "oracle": 90, "bf16": 100},
)
QUICK = Plan(
    shape="toy",
    rows=(1, 4, 8),
    warm_steps=3,
    timed_steps=8,
    concurrency=(1, 4),
    prompt_len=4,
    out_tokens=8,
    oracle_sizes=("toy",),
    oracle_prompts=4,
    oracle_tokens=6,
    agree_prompts=2,
    agree_tokens=4,
    boxes={"pass_time": 60, "decode": 60, "oracle": 60, "bf16": 60},
)


# ---------------------------------------------------------------------------- results


class Results:
    """Rows of the report; ``on_change`` runs after every row (a child saves its rows, the
    parent rewrites the report), so a killed run keeps what it had."""

    def __init__(self, t0: float, on_change: Callable[[list[dict[str, Any]]], None]) -> None:
        self.t0 = t0
        self.on_change = on_change
        self.rows: list[dict[str, Any]] = []

    def add(
        self,
        section: str,
        config: str,
        result: str,
        detail: str = "",
        *,
        failed: bool = False,
        echo: bool = True,
        **extra: Any,
    ) -> None:
        row = {
            "section": section,
            "config": config,
            "result": result,
            "detail": detail,
            "failed": failed,
            **extra,
        }
        self.rows.append(row)
        if echo:
            print(f"[{time.time() - self.t0:6.1f}s] {section} | {config} | {result} | {detail}")
            sys.stdout.flush()
        self.on_change(self.rows)

    def error(self, section: str, config: str, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(exc))
        print(text, flush=True)  # the whole traceback in the log; the table gets its first line
        self.add(
            section,
            config,
            "FAILED",
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400],
            failed=True,
            traceback=text[-4000:],
        )


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# rlt device check", ""]
    for key in ("date", "hardware", "device", "commit", "command", "elapsed"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    if meta.get("note"):
        lines += ["", meta["note"]]
    lines += ["", TABLE_HEADER, "|---|---|---|---|"]
    for r in rows:
        cells = [str(r[k]).replace("|", "/").replace("\n", " ") for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- engine helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device(device: torch.device) -> None:
    gc.collect()  # captured graphs and KV caches go with their engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_engine(
    model: OuroModel, *, rows: int, tokens_per_request: int, mode: DecodeMode, prompt_len: int
) -> LLMEngine:
    """An engine sized for ``rows`` requests of ``tokens_per_request`` tokens each, with
    room to spare so admission never holds a request back."""
    from services.common.config import SchedulerConfig
    from services.engine.engine import LLMEngine
    from services.worker.static_decode import DecodeMode

    block_size = 16
    planes = model.cfg.total_ut_steps  # the default LAST_EXITED layout keeps one per depth
    per_request = -(-tokens_per_request // block_size) * planes
    config = SchedulerConfig(
        max_num_seqs=rows,
        max_num_batched_tokens=max(2048, rows * prompt_len),
        block_size=block_size,
        num_blocks=2 * per_request * rows + 16,
    )
    # graphs need CUDA; elsewhere the same static passes run eagerly (what a graph replays)
    if mode is DecodeMode.GRAPHS and model.device.type != "cuda":
        mode = DecodeMode.PADDED
    engine = LLMEngine(model, config, decode_mode=mode)
    _keep_tracebacks(engine)
    return engine


def _keep_tracebacks(engine: LLMEngine) -> None:
    """The executor turns a worker exception into an error event with one line; keep the
    traceback too, since on a lent GPU the log is all there is."""
    runner = engine.runner
    execute = runner.execute

    def traced(batch: Any) -> Any:  # a Batch in, a BatchResult out
        try:
            return execute(batch)
        except Exception:
            runner.last_traceback = traceback.format_exc()
            raise

    runner.last_traceback = None  # type: ignore[attr-defined]
    runner.execute = traced  # type: ignore[method-assign]


def _raise_error_event(engine: LLMEngine, event: ErrorEvent) -> NoReturn:
    tb = getattr(engine.runner, "last_traceback", None)
    raise RuntimeError(
        f"request {event.request_id} failed ({event.code}): {event.message}"
        + (f"\nworker traceback:\n{tb}" if tb else "")
    )


def run_requests(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    deadline: float,
    tag: str,
) -> list[FinishedEvent]:
    """Runs the prompts to completion; their finished events in order. Raises on an error
    event (with the worker's traceback) or past the deadline."""
    from messages.api import ErrorEvent, FinishedEvent

    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, list(prompt), p)
    finished: dict[str, FinishedEvent] = {}
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            for rid in ids:
                engine.abort_request(rid)
            raise TimeoutError(f"section time box reached with {len(finished)}/{len(ids)} done")
        for event in engine.step():
            if isinstance(event, ErrorEvent):
                _raise_error_event(engine, event)
            elif isinstance(event, FinishedEvent):
                finished[event.request_id] = event
    return [finished[rid] for rid in ids]


def _mode_label(engine: LLMEngine, asked: DecodeMode) -> str:
    static = engine.runner.static
    actual = static.mode if static is not None else "eager"
    return str(asked) if actual == asked else f"{asked}->{actual}"


def _random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------- section contexts


@dataclass
class Child:
    """What a section needs: sizes, device, the bf16 checkpoint, its rows, its deadline."""

    plan: Plan
    device: torch.device
    ckpt: Path | None
    res: Results
    deadline: float
    tmp: Path

    def load(self, dtype: torch.dtype) -> OuroModel:
        from services.worker.model.ouro import OuroModel

        if self.ckpt is None or not (self.ckpt / "config.json").exists():
            raise RuntimeError("no checkpoint: the setup row says why")
        t0 = time.perf_counter()
        model = OuroModel.from_checkpoint(self.ckpt, dtype=dtype, device=self.device)
        _sync(self.device)
        print(
            f"  loaded {self.plan.shape} as {_dtype_name(dtype)} on {self.device} in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        return model

    def out_of_time(self, section: str, config: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.res.add(section, config, "SKIPPED", "section time box reached", failed=True)
        return True


# ---------------------------------------------------------------------------- 1. pass_time


@dataclass
class PassTiming:
    ms_per_pass: float
    execute_ms_per_pass: float
    passes: int
    ctx_tokens: float  # context tokens read per pass, summed over its rows (mean)
    coda_passes: int  # timed passes that sampled tokens (and so read the lm_head)
    static_passes: int
    to_host_per_pass: float
    decode_only: bool


def time_decode_passes(engine: LLMEngine, n: int, plan: Plan, device: torch.device) -> PassTiming:
    """N requests, all decoding at fixed depth: times ``timed_steps`` engine steps (one
    core pass each) after ``warm_steps`` that capture graphs and compile kernels."""
    from messages.api import ErrorEvent, FinishedEvent, TokenEvent
    from messages.sampling import SamplingParams

    cfg = engine.model.cfg
    depth = cfg.total_ut_steps
    params = SamplingParams(
        max_tokens=(plan.warm_steps + plan.timed_steps) // depth + 8,
        temperature=0.0,
        ignore_eos=True,
        exit_threshold=1.0,
    )
    rng = random.Random(n)
    ids = [f"pass-{n}-{i}" for i in range(n)]
    prompts = _random_prompts(rng, n, plan.prompt_len, cfg.vocab_size)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    generated = dict.fromkeys(ids, 0)

    def step() -> int:
        tokens = 0
        for event in engine.step():
            if isinstance(event, ErrorEvent):
                _raise_error_event(engine, event)
            if isinstance(event, FinishedEvent):
                raise RuntimeError(f"{event.request_id} finished inside the timed window")
            if isinstance(event, TokenEvent):
                generated[event.request_id] += 1
                tokens += 1
        return tokens

    for _ in range(200):  # prefill: until every request has its first token
        if all(generated.values()):
            break
        step()
    else:
        raise RuntimeError(f"only {sum(map(bool, generated.values()))}/{n} requests got going")
    for _ in range(plan.warm_steps):
        step()
    runner = engine.runner
    stats, counts = runner.stats, runner.transfer.counts
    p0, r0, b0, e0, h0 = (
        stats.core_passes,
        stats.core_rows,
        stats.batches,
        stats.execute_s,
        counts.to_host,
    )
    s0 = runner.static.replays if runner.static is not None else 0
    ctx = coda = 0
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(plan.timed_steps):
        ctx += sum(plan.prompt_len + g for g in generated.values())
        coda += step() > 0
    _sync(device)
    seconds = time.perf_counter() - t0
    passes = stats.core_passes - p0
    timing = PassTiming(
        ms_per_pass=seconds / passes * 1e3,
        execute_ms_per_pass=(stats.execute_s - e0) / passes * 1e3,
        passes=passes,
        ctx_tokens=ctx / plan.timed_steps,
        coda_passes=coda,
        static_passes=(runner.static.replays if runner.static is not None else 0) - s0,
        to_host_per_pass=(counts.to_host - h0) / passes,
        decode_only=stats.batches - b0 == passes == plan.timed_steps
        and stats.core_rows - r0 == n * passes,
    )
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():  # drain what is in flight
        engine.step()
    return timing


def section_pass_time(c: Child) -> None:
    from services.worker.static_decode import DecodeMode

    plan = c.plan
    model = c.load(torch.bfloat16)
    depth = model.cfg.total_ut_steps
    tokens = plan.prompt_len + (plan.warm_steps + plan.timed_steps) // depth + 10
    for mode in (DecodeMode.GRAPHS, DecodeMode.EAGER):
        for n in plan.rows:
            label = f"{n} row{'s' if n > 1 else ''}, {mode}"
            if c.out_of_time("pass_time", label):
                continue
            try:
                engine = make_engine(
                    model, rows=n, tokens_per_request=tokens, mode=mode, prompt_len=plan.prompt_len
                )
                label = f"{n} row{'s' if n > 1 else ''}, {_mode_label(engine, mode)}"
                t = time_decode_passes(engine, n, plan, c.device)
                # a static mode whose timed passes ran eagerly would time the wrong thing
                static_ok = mode is DecodeMode.EAGER or t.static_passes == t.passes
            except Exception as exc:
                c.res.error("pass_time", label, exc)
                continue
            finally:
                engine = None
                _free_device(c.device)
            c.res.add(
                "pass_time",
                label,
                f"{t.ms_per_pass:.3f} ms/pass",
                f"bf16 depth {depth}; {t.passes} passes timed after {plan.warm_steps} warm-up "
                f"steps; {t.execute_ms_per_pass:.3f} ms/pass inside the runner (the rest is "
                f"scheduling); {t.static_passes} static passes; {t.to_host_per_pass:.2f} host "
                f"syncs/pass; {t.coda_passes} passes with the coda; mean context "
                f"{t.ctx_tokens / n:.1f} tokens/row"
                + ("" if t.decode_only else "; NOT decode-only: one pass per step of n rows")
                + ("" if static_ok else "; NOT every pass static"),
                failed=not (t.decode_only and static_ok),
                rows=n,
                mode=str(mode),
                ms_per_pass=t.ms_per_pass,
                execute_ms_per_pass=t.execute_ms_per_pass,
                passes=t.passes,
                ctx_tokens=t.ctx_tokens,
                coda_passes=t.coda_passes,
            )


# ---------------------------------------------------------------------------- 2. decode


@dataclass
class DecodeRun:
    decode_tokens: int
    decode_seconds: float
    passes: int
    mean_depth: float


def timed_generation(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    device: torch.device,
    deadline: float,
) -> DecodeRun:
    """Runs to completion; the decode clock starts once every request has its first
    (prefill) token, so prompt processing does not count as decode throughput."""
    from messages.api import ErrorEvent, TokenEvent

    ids = [f"dec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    t_decode: float | None = None
    p_decode = 0
    depths: list[int] = []
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            for rid in ids:
                engine.abort_request(rid)
            raise TimeoutError("section time box reached mid-run")
        for event in engine.step():
            if isinstance(event, ErrorEvent):
                _raise_error_event(engine, event)
            if not isinstance(event, TokenEvent):
                continue
            if event.index == 0:
                started.add(event.request_id)
                if len(started) == len(ids):
                    _sync(device)
                    t_decode = time.perf_counter()
                    p_decode = engine.runner.stats.core_passes
            elif t_decode is not None:
                depths.append(event.exit_depth)
    _sync(device)
    if t_decode is None:
        raise RuntimeError("not every request got its first token")
    return DecodeRun(
        decode_tokens=len(depths),
        decode_seconds=time.perf_counter() - t_decode,
        passes=engine.runner.stats.core_passes - p_decode,
        mean_depth=sum(depths) / len(depths) if depths else float("nan"),
    )


def section_decode(c: Child) -> None:
    from messages.sampling import SamplingParams
    from services.worker.static_decode import DecodeMode, buckets

    plan = c.plan
    model = c.load(torch.bfloat16)
    vocab = model.cfg.vocab_size
    top = max(plan.concurrency)
    engine = make_engine(
        model,
        rows=top,
        tokens_per_request=plan.prompt_len + plan.out_tokens + 1,
        mode=DecodeMode.GRAPHS,
        prompt_len=plan.prompt_len,
    )
    mode = _mode_label(engine, DecodeMode.GRAPHS)
    rng = random.Random(1)
    t0 = time.perf_counter()
    # every bucket a run can shrink into is captured before any clock starts
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    for b in buckets(top):
        run_requests(engine, _random_prompts(rng, b, plan.prompt_len, vocab), warm, c.deadline, "w")
    print(f"  warm-up of buckets {buckets(top)}: {time.perf_counter() - t0:.1f} s", flush=True)
    for exit_mode, threshold, min_loops in (("off", 1.0, 2), ("on", 0.7, 1)):
        params = SamplingParams(
            max_tokens=plan.out_tokens,
            temperature=0.0,
            ignore_eos=True,
            exit_threshold=threshold,
            min_loops=min_loops,
        )
        for n in plan.concurrency:
            label = f"c={n}, exit {exit_mode} ({threshold}, min_loops {min_loops}), {mode}"
            if c.out_of_time("decode", label):
                continue
            try:
                prompts = _random_prompts(rng, n, plan.prompt_len, vocab)
                r = timed_generation(engine, prompts, params, c.device, c.deadline)
            except Exception as exc:
                c.res.error("decode", label, exc)
                continue
            tok_s = r.decode_tokens / r.decode_seconds if r.decode_seconds > 0 else 0.0
            c.res.add(
                "decode",
                label,
                f"{tok_s:,.1f} tok/s",
                f"{r.decode_tokens} decode tokens in {r.decode_seconds:.2f} s; mean exit depth "
                f"{r.mean_depth:.2f}; {r.passes} core passes, "
                f"{r.decode_seconds / max(r.passes, 1) * 1e3:.3f} ms/pass",
                concurrency=n,
                exit=exit_mode,
                tok_s=tok_s,
                mean_depth=r.mean_depth,
            )


# ---------------------------------------------------------------------------- 3. hbm


def pass_bytes(cost: SimCostModel, ctx_tokens: float) -> float:
    """Bytes a decode core pass must read from HBM: every core weight once, and the K and
    V of each row's context (``ctx_tokens`` summed over rows) at its depth's plane."""
    return cost.core_weight_bytes + ctx_tokens * cost.kv_bytes_per_token


def hbm_rows(pass_rows: list[dict[str, Any]], shape: str, res: Results, *, on_cpu: bool) -> None:
    """Each measured pass against what HBM alone allows, with the byte counts of the sim's
    cost model (bf16: 2 bytes a value)."""
    from services.worker.model.toy import toy_config
    from services.worker.sim import SimCostModel

    cost = SimCostModel.for_model(toy_config(shape), dtype_bytes=2)
    res.add(
        "hbm",
        f"{shape} bf16, {cost.bytes_per_s / 1e12:.1f} TB/s",
        f"{cost.core_weight_bytes / cost.bytes_per_s * 1e3:.4g} ms/pass floor",
        f"core weights {cost.core_weight_bytes / 1e9:.4g} GB per pass; KV "
        f"{cost.kv_bytes_per_token / 1e3:.4g} kB per context token of a row; the lm_head "
        f"({cost.coda_weight_bytes / 1e9:.4g} GB, read by passes that sample) is not in the "
        f"bound but is in the measured time"
        + ("; CPU run: CPU times against an H200 bound mean nothing" if on_cpu else ""),
    )
    measured = [r for r in pass_rows if r.get("ms_per_pass")]
    if not measured:
        res.add("hbm", "measured passes", "FAILED", "no pass_time measurement", failed=True)
        return
    for r in measured:
        n, ctx, ms = r["rows"], r["ctx_tokens"], r["ms_per_pass"]
        read = pass_bytes(cost, ctx)
        bound_ms = read / cost.bytes_per_s * 1e3
        # a decode row is one query over its context: query-key pairs = context tokens
        roof_ms = cost.core_pass_s(n, round(ctx), round(ctx)) * 1e3
        res.add(
            "hbm",
            r["config"],
            f"{100 * bound_ms / ms:.3g}% of HBM bound",
            f"bound {bound_ms:.4g} ms ({read / 1e9:.4g} GB: weights + KV of {ctx:.0f} context "
            f"tokens) vs {ms:.4g} ms/pass measured; {100 * bound_ms / r['execute_ms_per_pass']:.3g}"
            f"% of the {r['execute_ms_per_pass']:.4g} ms inside the runner; with the compute "
            f"roof too the bound is {roof_ms:.4g} ms",
            rows=n,
            mode=r.get("mode"),
            bound_ms=bound_ms,
            hbm_fraction=bound_ms / ms,
        )


# ---------------------------------------------------------------------------- 4. oracle


@dataclass
class Comparison:
    compared: int  # tokens equal in id and exit depth, up to a near-tie if any
    total: int  # tokens the oracle generated
    near_tie: str | None = None  # where the comparison stopped, and why
    mismatch: str | None = None


def compare_with_oracle(finished: FinishedEvent, expected: OracleResult) -> Comparison:
    """Token ids and exit depths must equal the oracle's. At a token where the oracle is
    within TIE_EPS of a tie, rounding may legitimately go either way: stop there (a top-2
    gap tie still has to agree on the exit depth, which came before the logits)."""
    total = len(expected.steps)
    tokens, depths = finished.token_ids, finished.exit_depths
    for i, step in enumerate(expected.steps):
        if step.threshold_margin < TIE_EPS:
            return Comparison(i, total, f"token {i}: exit margin {step.threshold_margin:.1e}")
        if step.top2_gap < TIE_EPS:
            if i < len(depths) and depths[i] == step.exit_depth:
                return Comparison(i, total, f"token {i}: top-2 gap {step.top2_gap:.1e}")
            got = depths[i] if i < len(depths) else "none"
            return Comparison(i, total, mismatch=f"token {i}: depth {got} vs {step.exit_depth}")
        if i >= len(tokens):
            return Comparison(i, total, mismatch=f"engine stopped after {len(tokens)} tokens")
        if (tokens[i], depths[i]) != (step.token_id, step.exit_depth):
            return Comparison(
                i,
                total,
                mismatch=f"token {i}: engine {tokens[i]}@{depths[i]}, oracle "
                f"{step.token_id}@{step.exit_depth} (top-2 gap {step.top2_gap:.2e}, exit "
                f"margin {step.threshold_margin:.2e})",
            )
    if tokens != expected.token_ids:
        return Comparison(total, total, mismatch=f"engine went on: {len(tokens)} tokens")
    if finished.finish_reason != expected.finish_reason:
        return Comparison(
            total, total, mismatch=f"finish {finished.finish_reason} vs {expected.finish_reason}"
        )
    return Comparison(total, total)


def section_oracle(c: Child) -> None:
    from messages.sampling import SamplingParams
    from services.oracle import SerialOracle
    from services.worker.model.ouro import OuroModel
    from services.worker.model.toy import write_toy_checkpoint
    from services.worker.static_decode import DecodeMode

    plan = c.plan
    for size in plan.oracle_sizes:
        if c.out_of_time("oracle", f"{size} fp32"):
            continue
        try:
            ckpt = write_toy_checkpoint(c.tmp / f"oracle-{size}", seed=0, size=size)
            oracle = SerialOracle(ckpt)
            model = OuroModel.from_checkpoint(ckpt, dtype=torch.float32, device=c.device)
            cfg = model.cfg
            rng = random.Random(2)
            prompts = [
                [rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(3, 12))]
                for _ in range(plan.oracle_prompts)
            ]
            # fixed depth and three early-exit thresholds, mixed in one batch
            params = [
                SamplingParams(
                    max_tokens=plan.oracle_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    exit_threshold=threshold,
                    min_loops=1 if threshold < 1.0 else 2,
                ).resolve(cfg.total_ut_steps, cfg.vocab_size)
                for threshold in (1.0, 0.9, 0.7, 0.5) * plan.oracle_prompts
            ][: plan.oracle_prompts]
            t0 = time.perf_counter()
            expected = [
                oracle.generate(
                    prompt,
                    max_tokens=p.max_tokens,
                    min_loops=p.min_loops,
                    max_loops=p.max_loops,
                    exit_threshold=p.exit_threshold,
                    ignore_eos=True,
                )
                for prompt, p in zip(prompts, params, strict=True)
            ]
            print(f"  oracle {size}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:
            c.res.error("oracle", f"{size} fp32", exc)
            continue
        for mode in (DecodeMode.EAGER, DecodeMode.GRAPHS):
            label = f"{size} fp32, {mode}"
            if c.out_of_time("oracle", label):
                continue
            try:
                engine = make_engine(
                    model,
                    rows=len(prompts),
                    tokens_per_request=12 + plan.oracle_tokens + 1,
                    mode=mode,
                    prompt_len=12,
                )
                label = f"{size} fp32, {_mode_label(engine, mode)}"
                finished = run_requests(engine, prompts, params, c.deadline, f"or-{mode}")
                static = engine.runner.static
                replays = static.replays if static is not None else 0
            except Exception as exc:
                c.res.error("oracle", label, exc)
                continue
            finally:
                engine = None
                _free_device(c.device)
            comps = [compare_with_oracle(f, e) for f, e in zip(finished, expected, strict=True)]
            compared = sum(x.compared for x in comps)
            total = sum(x.total for x in comps)
            ties = [f"r{i} {x.near_tie}" for i, x in enumerate(comps) if x.near_tie]
            bad = [f"r{i} {x.mismatch}" for i, x in enumerate(comps) if x.mismatch]
            depths = [d for f in finished for d in f.exit_depths]
            # graphs mode that never went through a static pass would test nothing new
            unused = mode is DecodeMode.GRAPHS and replays == 0
            c.res.add(
                "oracle",
                label,
                ("MISMATCH" if bad else "ok") + f" {compared}/{total} tokens",
                f"{len(prompts)} requests, thresholds 1.0/0.9/0.7/0.5, mean exit depth "
                f"{sum(depths) / max(len(depths), 1):.2f}; {replays} static passes; "
                f"near-ties {len(ties)}: {'; '.join(ties) or 'none'}"
                + (f"; mismatches: {'; '.join(bad)}" if bad else "")
                + ("; NO static pass ran" if unused else ""),
                failed=bool(bad) or unused,
                compared=compared,
                total=total,
                near_ties=ties,
                mismatches=bad,
            )
        model = None
        _free_device(c.device)


# ---------------------------------------------------------------------------- 5. bf16


def section_bf16(c: Child) -> None:
    from messages.sampling import SamplingParams
    from services.worker.static_decode import DecodeMode

    plan = c.plan
    rng = random.Random(3)
    label = f"{plan.shape} bf16 vs fp32, fixed depth"
    fp32 = c.load(torch.float32)
    cfg = fp32.cfg
    prompts = _random_prompts(rng, plan.agree_prompts, plan.prompt_len, cfg.vocab_size)
    greedy = SamplingParams(
        max_tokens=plan.agree_tokens, temperature=0.0, ignore_eos=True, exit_threshold=1.0
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    longest = plan.prompt_len + plan.agree_tokens + 1
    rows = min(128, plan.agree_prompts * plan.agree_tokens)

    def engine_for(model: OuroModel) -> LLMEngine:
        return make_engine(
            model,
            rows=rows,
            tokens_per_request=longest,
            mode=DecodeMode.GRAPHS,
            prompt_len=longest,
        )

    reference = run_requests(engine_for(fp32), prompts, greedy, c.deadline, "fp32")
    fp32 = None
    _free_device(c.device)
    bf16 = c.load(torch.bfloat16)
    engine = engine_for(bf16)
    free = run_requests(engine, prompts, greedy, c.deadline, "bf16")
    # teacher-forced: every fp32 prefix as a prompt, one greedy bf16 token each
    forced = [
        p + ref.token_ids[:i]
        for p, ref in zip(prompts, reference, strict=True)
        for i in range(len(ref.token_ids))
    ]
    want = [t for ref in reference for t in ref.token_ids]
    got = [f.token_ids[0] for f in run_requests(engine, forced, one, c.deadline, "tf")]
    hits = sum(a == b for a, b in zip(got, want, strict=True))
    diverge = [
        first_divergence(f.token_ids, r.token_ids) for f, r in zip(free, reference, strict=True)
    ]
    same = sum(d is None for d in diverge)
    earliest = min((d for d in diverge if d is not None), default=None)
    c.res.add(
        "bf16",
        label,
        f"top-1 {100 * hits / len(want):.1f}%",
        f"teacher-forced: {hits}/{len(want)} greedy tokens equal over {len(prompts)} prompts "
        f"(every fp32 prefix, one bf16 token); free-running: {same}/{len(prompts)} sequences "
        f"equal"
        + (f", earliest divergence at token {earliest}" if earliest is not None else "")
        + "; random weights: information only",
        top1=hits / len(want),
        first_divergence=diverge,
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (in value or length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------- child process


SECTION_FNS: dict[str, Callable[[Child], None]] = {
    "pass_time": section_pass_time,
    "decode": section_decode,
    "oracle": section_oracle,
    "bf16": section_bf16,
}


def child_main(args: argparse.Namespace, plan: Plan) -> int:
    result = Path(args.result)

    def save(rows: list[dict[str, Any]]) -> None:
        result.write_text(json.dumps(rows))

    res = Results(args.t0, save)
    box = plan.boxes[args.section]
    # leave time to write the last rows before the parent's hard kill
    deadline = time.monotonic() + box - min(15.0, box / 6)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else None
        c = Child(plan, torch.device(args.device), ckpt, res, deadline, Path(tmp))
        try:
            SECTION_FNS[args.section](c)
        except Exception as exc:  # the section's remaining rows are lost, the run is not
            res.error(args.section, "section", exc)
    return 0


def _child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":  # toy-sized matmuls: more threads only contend (10x slower on 2 cores)
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(
    section: str, args: argparse.Namespace, plan: Plan, ckpt: Path | None, res: Results
) -> None:
    """One section in a child process with a hard time box; its rows join ``res``."""
    box = plan.boxes[section]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_file = Path(fh.name)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        section,
        "--result",
        str(result_file),
        "--device",
        args.device,
        "--t0",
        repr(args.t0),
    ]
    if ckpt is not None:
        cmd += ["--ckpt", str(ckpt)]
    if args.quick:
        cmd.append("--quick")
    start = time.perf_counter()
    print(f"[{time.time() - args.t0:6.1f}s] == {section} (time box {box:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(args.device), timeout=box)
        status = None if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"killed at its {box:.0f} s time box"
    try:
        rows = json.loads(result_file.read_text() or "[]")
    except (OSError, json.JSONDecodeError):
        rows = []
    finally:
        result_file.unlink(missing_ok=True)
    for row in rows:
        res.add(**row, echo=False)  # the child printed them already
    took = time.perf_counter() - start
    if status is not None:
        res.add(section, "section", "FAILED", f"{status} after {took:.0f} s", failed=True)
    elif not rows:
        res.add(section, "section", "FAILED", "no rows came back", failed=True)
    print(f"[{time.time() - args.t0:6.1f}s] == {section} done in {took:.1f} s", flush=True)


# ---------------------------------------------------------------------------- parent


def _git(*argv: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def commit_line(given: str | None) -> str:
    sha = _git("rev-parse", "HEAD")
    if sha is None:  # a lent machine gets the working tree without .git
        return f"{given} (as given)" if given else "unknown (no git checkout)"
    dirty = _git("status", "--porcelain")
    return sha + (" + uncommitted changes" if dirty else "")


def hardware_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{torch.cuda.get_device_name(device)} ({props.total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({os.cpu_count()} cores), torch {torch.__version__}; no GPU"


def env_row(device: torch.device, res: Results) -> None:
    from kernels.ops import triton_available

    cuda = device.type == "cuda"
    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    missing = []
    for mod in ("msgspec", "structlog", "safetensors", "tokenizers", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    triton_ok = triton_available()
    if triton_ok:
        import triton

        parts.append(f"triton {triton.__version__}" + ("" if cuda else " (unused on the CPU)"))
    else:
        # the ops fall back to their torch references: the numbers would not be the kernels'
        parts.append("no usable triton" + (": the pass runs torch references" if cuda else ""))
    if missing:
        parts.append(f"MISSING {', '.join(missing)} (carry wheels: docs/gpu.md)")
    bad_triton = cuda and not triton_ok
    result = "missing packages" if missing else "no triton" if bad_triton else "ok"
    res.add("env", str(device), result, "; ".join(parts), failed=bool(missing) or bad_triton)


def write_checkpoint(plan: Plan, device: torch.device, where: Path, res: Results) -> Path | None:
    """The random bf16 checkpoint sections 1, 2 and 5 load (drawn on the GPU when there is
    one: seconds rather than a minute of CPU randn)."""
    from services.worker.model.toy import write_toy_checkpoint

    t0 = time.perf_counter()
    try:
        ckpt = write_toy_checkpoint(
            where, seed=0, size=plan.shape, dtype=torch.bfloat16, gen_device=device
        )
    except Exception as exc:
        res.error("setup", f"{plan.shape} bf16 checkpoint", exc)
        return None
    _free_device(device)
    nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    res.add(
        "setup",
        f"{plan.shape} bf16 random checkpoint",
        f"{nbytes / 1e9:.4g} GB",
        f"written in {time.perf_counter() - t0:.1f} s",
    )
    return ckpt


def default_out(quick: bool) -> Path:
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "docs" / "benchmarks"
    return base / ("device_check_quick.md" if quick else "device_check.md")


def parent_main(args: argparse.Namespace, plan: Plan, argv: list[str]) -> int:
    out = Path(args.out) if args.out else default_out(args.quick)
    if out.suffix != ".md":  # a folder
        out = out / ("device_check_quick.md" if args.quick else "device_check.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{device}{' (--quick)' if args.quick else ''}",
        "commit": commit_line(args.commit),
        "command": shlex.join(["python3", "scripts/device_check.py", *argv]),
        "note": CPU_NOTE
        if device.type == "cpu"
        else "**Quick run: toy checkpoint and tiny counts, not the 1.4B numbers.**"
        if args.quick
        else "",
    }

    def save(rows: list[dict[str, Any]]) -> None:
        meta["elapsed"] = f"{time.time() - args.t0:.0f} s"
        out.write_text(render(meta, rows))
        out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))

    res = Results(args.t0, save)
    if device.type == "cuda" and not torch.cuda.is_available():
        meta["hardware"] = hardware_line(torch.device("cpu"))
        res.add("env", str(device), "FAILED", "CUDA is not available here", failed=True)
    else:
        meta["hardware"] = hardware_line(device)
        if meta["note"]:
            print(meta["note"], flush=True)
        env_row(device, res)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if only & {"pass_time", "decode", "bf16"}:
                ckpt = write_checkpoint(plan, device, Path(tmp) / "ckpt", res)
            for section in SECTIONS:
                if section not in only:
                    continue
                if section == "hbm":
                    pass_rows = [r for r in res.rows if r["section"] == "pass_time"]
                    try:
                        hbm_rows(pass_rows, plan.shape, res, on_cpu=device.type == "cpu")
                    except Exception as exc:
                        res.error("hbm", "section", exc)
                else:
                    run_child(section, args, plan, ckpt, res)
    save(res.rows)
    print("\n" + render(meta, res.rows), end="", flush=True)
    print(f"\nreport: {out} (+ {out.with_suffix('.json').name})", flush=True)
    return 1 if any(r.get("failed") for r in res.rows) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes on the CPU: a dry run")
    parser.add_argument("--device", help="cuda (default) or cpu (default with --quick)")
    parser.add_argument(
        "--out",
        help="report .md path or folder (JSON beside it); default $OUT, else docs/benchmarks/",
    )
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--commit", help="commit to record where the tree has no .git")
    parser.add_argument("--section", choices=CHILD_SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=time.time(), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick else "cuda")
    if args.only and not set(args.only.split(",")) <= set(SECTIONS):
        parser.error(f"--only takes {','.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL
    if args.section:
        return child_main(args, plan)
    return parent_main(args, plan, argv)


if __name__ == "__main__":
    sys.exit(main())
