"""``rlt bench --only wcpb``: wavefront chunked prefill (WCPB) against atomic chunked prefill,
under long prompts arriving among decoding requests."""

from __future__ import annotations

from services.bench import workloads as wl
from services.bench.comparison import (
    ATOMIC_PREFILL,
    Arm,
    BenchSettings,
    Comparison,
    RatioSpec,
    Target,
    base_config,
)

# WCPB's offered loads (fractions of capacity): a light one and a busy one
WCPB_LOADS = (0.35, 0.6)


def wcpb(s: BenchSettings) -> Comparison:
    workload = wl.mixed(s.scale, s.vocab, s.concurrency, s.seed)
    chunk, budget = (16, 32) if s.quick else (64, 128)
    p99 = Target("WCPB p99 ITL <= 0.7x atomic prefill's", high=0.7)
    equal = Target("at equal throughput: tokens/s ratio within 0.95..1.05", low=0.95, high=1.05)
    ratios = [
        RatioSpec("mixed", "itl_ms_p99", "wcpb", "atomic", "ITL p99, WCPB / atomic", target=p99),
        RatioSpec("mixed", "itl_ms_p50", "wcpb", "atomic", "ITL p50, WCPB / atomic"),
        RatioSpec("mixed", "ttft_ms_p50", "wcpb", "atomic", "TTFT p50, WCPB / atomic"),
        RatioSpec("mixed", "ttft_ms_p99", "wcpb", "atomic", "TTFT p99, WCPB / atomic"),
        RatioSpec(
            "mixed",
            "output_tokens_per_s",
            "wcpb",
            "atomic",
            "tokens/s, WCPB / atomic",
            target=equal,
        ),
    ]
    if s.rate is not None:
        workload = workload.with_rate(s.rate)
    return Comparison(
        name="wcpb",
        title="Wavefront chunked prefill (WCPB) vs atomic chunked prefill",
        question=(
            "Under long prompts arriving among decoding requests, does running prefill as "
            "single-depth chunks inside decode passes (WCPB) keep inter-token latency down "
            "compared with atomic chunks that run every depth while decode waits?"
        ),
        base=base_config(s, [workload], prefill_chunk_size=chunk, max_num_batched_tokens=budget),
        workloads=[workload],
        arms=[
            Arm(
                "atomic",
                f"atomic chunked prefill (chunk {chunk}, budget {budget})",
                ATOMIC_PREFILL,
            ),
            Arm("wcpb", "WCPB (same chunk and budget)", {"wavefront_chunked_prefill": True}),
        ],
        ratios=ratios,
        plot_metrics=["itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "output_tokens_per_s"],
        loads=() if s.rate is not None else WCPB_LOADS,
        notes=[
            "Open loop (Poisson arrivals): both arms see the same offered load, so equal "
            "throughput holds while neither saturates. Unless --rate is given, it runs at "
            + " and ".join(f"{x:.0%}" for x in WCPB_LOADS)
            + " of the lower of the arms' closed-loop capacities, measured just before the "
            "runs; the targets are judged at each load.",
        ],
    )
