"""``rlt bench --only admission_bypass``: bounded admission bypass under KV pressure, strict
queue order against bypass."""

from __future__ import annotations

import math

from services.bench import workloads as wl
from services.bench.comparison import (
    Arm,
    BackendKind,
    BenchSettings,
    Comparison,
    RatioSpec,
    Target,
)
from services.common.config import SchedulerConfig

# admission bypass: KV for the largest footprint once per this many clients (8 at 32), so
# the long requests fill the pool and wait for it while short ones could still start
BYPASS_CLIENTS_PER_KV_LONG = 4
BYPASS_ARMS = (0, 2, 4, 8)  # max_admission_bypasses measured; 0 is strict queue order


def bypass_arm_name(bypasses: int) -> str:
    return "strict" if bypasses == 0 else f"bypass_{bypasses}"


def admission_bypass(s: BenchSettings) -> Comparison:
    quick = s.quick
    long = (
        wl.LengthMix(prompt=(96, 160), output=(16, 32))
        if quick
        else wl.LengthMix(prompt=(896, 1280), output=(128, 384))
    )
    short = (
        wl.LengthMix(prompt=(2, 6), output=(1, 4))
        if quick
        else wl.LengthMix(prompt=(4, 16), output=(2, 12))
    )
    workload = wl.long_and_short(
        s.vocab,
        s.concurrency,
        s.seed,
        long=long,
        short=short,
        long_share=0.25 if quick else 1 / 6,
        num_requests=(4 if quick else 3) * s.concurrency,
    )
    planes = s.limits.total_ut_steps
    footprint = max(
        math.ceil((r.num_prompt_tokens + r.max_tokens - 1) / s.block_size)
        for r in workload.requests
    )
    kv_longs = max(1, s.concurrency // BYPASS_CLIENTS_PER_KV_LONG)
    num_blocks = kv_longs * footprint * planes
    default = SchedulerConfig().max_admission_bypasses
    if default not in BYPASS_ARMS:
        raise ValueError(f"the default max_admission_bypasses {default} has no arm")
    default_arm = bypass_arm_name(default)
    arms = [
        Arm(
            bypass_arm_name(n),
            "strict queue order" if n == 0 else f"backfill, and {n} counted passes per head",
            {"max_admission_bypasses": n},
        )
        for n in BYPASS_ARMS
    ]
    # the same two orders with passes timed as Ouro-1.4B's on an H200: on this CPU a step
    # carrying long prompts costs ~100x a decode step, which no admission order can change
    sim_arms = [
        Arm(f"{a.name}_sim", f"{a.label}, SIMULATED H200 passes", a.overrides,
            BackendKind.IN_PROCESS_SIM)
        for a in arms
        if a.name in ("strict", default_arm)
    ]  # fmt: skip
    arms += sim_arms
    name = workload.name
    ratios = [
        RatioSpec(name, "ttft_ms_p99_short", default_arm, "strict",
                  f"short requests' TTFT p99, {default_arm} / strict",
                  target=Target("default: short TTFT p99 <= 0.3x strict order's", high=0.3)),
        RatioSpec(name, "latency_ms_mean_long", default_arm, "strict",
                  f"long requests' completion time (mean), {default_arm} / strict",
                  target=Target("default: long completion <= 1.2x strict order's", high=1.2)),
        # the same in engine steps: the schedule's own clock, free of this machine's noise
        RatioSpec(name, "ttft_steps_p99_short", default_arm, "strict",
                  f"short requests' TTFT p99 in engine steps, {default_arm} / strict",
                  target=Target("default: short TTFT p99 <= 0.3x strict order's (steps)",
                                high=0.3)),
        RatioSpec(name, "latency_steps_mean_long", default_arm, "strict",
                  f"long requests' completion time (mean) in engine steps, {default_arm} / "
                  "strict",
                  target=Target("default: long completion <= 1.2x strict order's (steps)",
                                high=1.2)),
        RatioSpec(name, "ttft_ms_p50_short", default_arm, "strict",
                  f"short requests' TTFT p50, {default_arm} / strict"),
        RatioSpec(name, "latency_ms_max_long", default_arm, "strict",
                  f"slowest long request, {default_arm} / strict"),
        RatioSpec(name, "wall_s", default_arm, "strict",
                  f"the whole run (until the last long finished), {default_arm} / strict"),
    ]  # fmt: skip
    for n in BYPASS_ARMS:
        if n in (0, default):
            continue
        arm = bypass_arm_name(n)
        ratios += [
            RatioSpec(name, "ttft_ms_p99_short", arm, "strict",
                      f"short requests' TTFT p99, {arm} / strict"),
            RatioSpec(name, "latency_ms_mean_long", arm, "strict",
                      f"long requests' completion time (mean), {arm} / strict"),
            RatioSpec(name, "ttft_steps_p99_short", arm, "strict",
                      f"short requests' TTFT p99 in engine steps, {arm} / strict"),
            RatioSpec(name, "latency_steps_mean_long", arm, "strict",
                      f"long requests' completion time (mean) in engine steps, {arm} / strict"),
        ]  # fmt: skip
    ratios += [
        RatioSpec(name, metric, f"{default_arm}_sim", "strict_sim",
                  f"{label}, {default_arm} / strict, SIMULATED H200 passes")
        for metric, label in (
            ("ttft_ms_p99_short", "short requests' TTFT p99"),
            ("latency_ms_mean_long", "long requests' completion time (mean)"),
        )
    ]  # fmt: skip
    return Comparison(
        name="admission_bypass",
        title="Bounded admission bypass under KV pressure: strict queue order vs bypass",
        question=(
            "When long requests fill the KV pool, the head of the queue often does not fit: "
            "under strict queue order every short request behind it waits for it. How much "
            "does letting requests that fit pass a refused head (backfills, estimated to end "
            "before the head could start, and at most N others) cut the short requests' time "
            "to first token, and what does it cost the long requests?"
        ),
        base=SchedulerConfig(
            max_num_seqs=s.concurrency, block_size=s.block_size, num_blocks=num_blocks
        ),
        workloads=[workload],
        arms=arms,
        ratios=ratios,
        plot_metrics=[
            "ttft_ms_p50_short",
            "ttft_ms_p99_short",
            "latency_ms_mean_long",
            "output_tokens_per_s",
        ],
        notes=[
            f"KV pool: {num_blocks} blocks of {s.block_size} tokens = the footprint of "
            f"{kv_longs} of the longest requests ({footprint} blocks x {planes} "
            "planes); watermark admission (the default).",
            "Closed loop: a client sends its next request when one ends, so short requests "
            "arrive behind the long ones that wait for KV. Completion time = sent to "
            "finished; TTFT = sent to the first token (queue wait included).",
            "Engine steps: the same measures counted in the engine's steps rather than "
            "seconds. The in-process engine's schedule does not depend on timing, so they are "
            "the same in every repeat, whatever else the machine runs.",
            "*_sim arms: the same schedule policy with every pass timed as Ouro-1.4B's on an "
            "H200 by the cost model (services/worker/sim.py) and tokens from a hash, not the "
            "model: SIMULATED, reported beside the targets, never as one.",
        ],
    )
