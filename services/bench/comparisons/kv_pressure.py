"""``rlt bench --only kv_pressure``: KV admission under KV pressure, reserve against
incremental against watermark."""

from __future__ import annotations

import math

from services.bench import workloads as wl
from services.bench.comparison import (
    Arm,
    BenchSettings,
    Comparison,
    RatioSpec,
    Target,
)
from services.common.config import KVAdmission, SchedulerConfig

# KV for this share of what every client's request needs at once (its whole footprint)
KV_PRESSURE_SHARE = 0.35
# the watermark fractions measured besides reserve (= 1) and incremental
KV_WATERMARKS = (0.25, 0.5)


def kv_admission_arm_name(policy: KVAdmission, watermark: float) -> str:
    if policy is KVAdmission.WATERMARK:
        return f"watermark_{round(watermark * 100)}"
    return str(policy)


def kv_pressure(s: BenchSettings) -> Comparison:
    workload = wl.kv_pressure(s.scale, s.vocab, s.concurrency, s.seed)
    footprint = max(
        math.ceil((r.num_prompt_tokens + r.max_tokens - 1) / s.block_size)
        for r in workload.requests
    )
    planes = s.limits.total_ut_steps
    concurrent = s.concurrency * footprint * planes
    num_blocks = max(footprint * planes, round(KV_PRESSURE_SHARE * concurrent))
    arms = [
        Arm("reserve", "reserve: whole footprint fits", {"kv_admission": KVAdmission.RESERVE}),
        Arm(
            "incremental",
            "incremental: seats only, preempt on shortfall",
            {"kv_admission": KVAdmission.INCREMENTAL},
        ),
    ]
    arms += [
        Arm(
            kv_admission_arm_name(KVAdmission.WATERMARK, f),
            f"watermark {f:g}: prompt fits, {f:.0%} of running decodes' footprint free",
            {"kv_admission": KVAdmission.WATERMARK, "kv_watermark": f},
        )
        for f in KV_WATERMARKS
    ]
    default = SchedulerConfig()
    default_arm = kv_admission_arm_name(default.kv_admission, default.kv_watermark)
    if default_arm not in {a.name for a in arms}:
        raise ValueError(f"the default admission {default_arm} has no arm in kv_pressure")
    keep = Target("default >= 0.95x this policy's tokens/s", low=0.95)
    ratios = [
        RatioSpec(
            workload.name,
            "recomputed_prompt_core_share",
            default_arm,
            default_arm,
            f"share of core rows recomputing prompts, {default_arm} (default)",
            target=Target("default <= 5% of core work on recomputed prompt tokens", high=0.05),
            value=True,
        )
    ]
    for arm in arms:
        if arm.name == default_arm:
            continue
        ratios += [
            RatioSpec(
                workload.name,
                "output_tokens_per_s",
                default_arm,
                arm.name,
                f"tokens/s, {default_arm} / {arm.name}",
                target=keep,
            ),
            RatioSpec(
                workload.name,
                "ttft_ms_p50",
                default_arm,
                arm.name,
                f"TTFT p50, {default_arm} / {arm.name}",
            ),
        ]
    return Comparison(
        name="kv_pressure",
        title="KV admission under KV pressure: reserve vs incremental vs watermark",
        question=(
            "With KV for about a third of what the clients' requests could need at once, and "
            "answers that mostly stop early, which admission wastes less: reserving every "
            "request's whole footprint (KV held for tokens never written), admitting on seats "
            "(prefills thrown away by preemption and recomputed), or a watermark in between?"
        ),
        base=SchedulerConfig(
            max_num_seqs=s.concurrency, block_size=s.block_size, num_blocks=num_blocks
        ),
        workloads=[workload],
        arms=arms,
        ratios=ratios,
        plot_metrics=[
            "output_tokens_per_s",
            "ttft_ms_p50",
            "recomputed_prompt_tokens_per_output_token",
            "reserved_unused_share",
        ],
        notes=[
            f"KV pool: {num_blocks} blocks of {s.block_size} tokens = {KV_PRESSURE_SHARE:.0%} "
            f"of {s.concurrency} clients x the largest footprint ({footprint} blocks x "
            f"{planes} planes).",
            "Short answers end at the first generated token that falls in a fixed random "
            f"{wl.STOP_FRACTION:.0%} of the vocabulary (stop_token_ids); greedy decoding makes "
            "that the same token in every arm, and no arm can know it in advance.",
            "Core share recomputing prompts = prompt token-loops run again after a preemption "
            "/ all core rows (every core pass's rows); '+ decode replays' adds the loops that "
            "rebuild a preempted request's generated tokens. Reserved unused share = blocks "
            "reserved and never written / blocks reserved (reserve only; the others reserve "
            "nothing).",
        ],
    )
