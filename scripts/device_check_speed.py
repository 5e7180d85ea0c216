"""The device check's speed sections (``scripts/device_check.py`` runs them):

1. ``pass_time``: ms per decode core pass at fixed depth, 1/32/128 rows, graphs on and off.
2. ``decode``: decode tokens/s at concurrency 1/32/128, early exit off and on, graphs on.
3. ``hbm``: the bytes each measured pass must read (core weights + KV, from the sim's cost
   model) per second of its measured time, as a share of the copy bandwidth the ``copy``
   section measured in the same run. Arithmetic on the ``pass_time`` rows, so it runs in the
   parent rather than in a child process of its own.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scripts.device_check_common import (
    Child,
    Plan,
    Results,
    free_device,
    make_engine,
    mode_label,
    raise_error_event,
    random_prompts,
    run_requests,
    sync_device,
)

if TYPE_CHECKING:  # the engine's imports stay lazy: the env row reports what is missing
    from messages.sampling import SamplingParams
    from services.engine.engine import LLMEngine
    from services.worker.sim import SimCostModel


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
    prompts = random_prompts(rng, n, plan.prompt_len, cfg.vocab_size)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    generated = dict.fromkeys(ids, 0)

    def step() -> int:
        tokens = 0
        for event in engine.step():
            if isinstance(event, ErrorEvent):
                raise_error_event(engine, event)
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
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(plan.timed_steps):
        ctx += sum(plan.prompt_len + g for g in generated.values())
        coda += step() > 0
    sync_device(device)
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
    from services.worker.passes.static_decode import DecodeMode

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
                label = f"{n} row{'s' if n > 1 else ''}, {mode_label(engine, mode)}"
                t = time_decode_passes(engine, n, plan, c.device)
                # a static mode whose timed passes ran eagerly would time the wrong thing
                static_ok = mode is DecodeMode.EAGER or t.static_passes == t.passes
            except Exception as exc:
                c.res.error("pass_time", label, exc)
                continue
            finally:
                engine = None
                free_device(c.device)
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
                raise_error_event(engine, event)
            if not isinstance(event, TokenEvent):
                continue
            if event.index == 0:
                started.add(event.request_id)
                if len(started) == len(ids):
                    sync_device(device)
                    t_decode = time.perf_counter()
                    p_decode = engine.runner.stats.core_passes
            elif t_decode is not None:
                depths.append(event.exit_depth)
    sync_device(device)
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
    from services.worker.passes.static_decode import DecodeMode, buckets

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
    mode = mode_label(engine, DecodeMode.GRAPHS)
    rng = random.Random(1)
    t0 = time.perf_counter()
    # every bucket a run can shrink into is captured before any clock starts
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    for b in buckets(top):
        run_requests(engine, random_prompts(rng, b, plan.prompt_len, vocab), warm, c.deadline, "w")
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
                prompts = random_prompts(rng, n, plan.prompt_len, vocab)
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


def hbm_rows(
    pass_rows: list[dict[str, Any]], shape: str, res: Results, copy_bytes_per_s: float | None
) -> None:
    """Each measured pass's bytes per second against the copy bandwidth of this run, with the
    byte counts of the sim's cost model (bf16: 2 bytes a value)."""
    from services.worker.model.toy import toy_config
    from services.worker.sim import SimCostModel

    cost = SimCostModel.for_model(toy_config(shape), dtype_bytes=2)
    if not copy_bytes_per_s:
        res.add("hbm", "copy bandwidth", "FAILED", "the copy section did not run", failed=True)
        return
    floor_ms = cost.core_weight_bytes / copy_bytes_per_s * 1e3
    res.add(
        "hbm",
        f"{shape} bf16 at {copy_bytes_per_s / 1e12:.3g} TB/s (copy)",
        f"{floor_ms:.4g} ms/pass floor",
        f"core weights {cost.core_weight_bytes / 1e9:.4g} GB per pass; KV "
        f"{cost.kv_bytes_per_token / 1e3:.4g} kB per context token of a row; the lm_head "
        f"({cost.coda_weight_bytes / 1e9:.4g} GB, read by passes that sample) is not counted "
        f"but is in the measured time",
    )
    measured = [r for r in pass_rows if r.get("ms_per_pass")]
    if not measured:
        res.add("hbm", "measured passes", "FAILED", "no pass_time measurement", failed=True)
        return
    for r in measured:
        n, ctx, ms = r["rows"], r["ctx_tokens"], r["ms_per_pass"]
        read = pass_bytes(cost, ctx)
        bytes_per_s = read / (ms / 1e3)
        # a decode row is one query over its context: query-key pairs = context tokens
        roof_ms = cost.core_pass_s(n, round(ctx), round(ctx)) * 1e3
        res.add(
            "hbm",
            r["config"],
            f"{100 * bytes_per_s / copy_bytes_per_s:.3g}% of copy bandwidth",
            f"{read / 1e9:.4g} GB (weights + KV of {ctx:.0f} context tokens) in {ms:.4g} "
            f"ms/pass = {bytes_per_s / 1e9:.4g} GB/s; inside the runner "
            f"{r['execute_ms_per_pass']:.4g} ms; the sim's H200 roofline with compute "
            f"{roof_ms:.4g} ms",
            rows=n,
            mode=r.get("mode"),
            bytes_per_s=bytes_per_s,
            copy_fraction=bytes_per_s / copy_bytes_per_s,
        )
