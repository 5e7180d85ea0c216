"""``rlt bench --only prefix_cache``: prefix caching on against off, on requests that share
long system prompts."""

from __future__ import annotations

import dataclasses

from services.bench import workloads as wl
from services.bench.comparison import (
    Arm,
    BenchSettings,
    Comparison,
    RatioSpec,
    base_config,
)


def prefix_cache(s: BenchSettings) -> Comparison:
    clients = max(1, s.concurrency // 8)
    workload = wl.shared_prefix(s.scale, s.vocab, clients, s.seed)
    # the same requests all at once: every prefix's first prefill is still running when its
    # other readers arrive, which only in-flight sharing turns into hits
    burst = dataclasses.replace(
        wl.shared_prefix(s.scale, s.vocab, max(clients, s.concurrency), s.seed),
        name="shared_prefix_burst",
    )
    ratios = [
        RatioSpec("shared_prefix", "ttft_ms_p50", "on", "off", "TTFT p50, on / off"),
        RatioSpec("shared_prefix", "ttft_ms_mean", "on", "off", "TTFT mean, on / off"),
        RatioSpec("shared_prefix", "output_tokens_per_s", "on", "off", "tokens/s, on / off"),
        RatioSpec(
            "shared_prefix",
            "core_passes_per_output_token",
            "on",
            "off",
            "core passes/token, on / off",
        ),
    ]
    # (without sharing a burst has no hits at all: its hit rate is a value, not a ratio)
    ratios.append(
        RatioSpec(burst.name, "prefix_hit_rate", "on", "on", "prefix hit rate, burst", value=True)
    )
    for metric, label in (("ttft_ms_p50", "TTFT p50"), ("output_tokens_per_s", "tokens/s")):
        ratios.append(
            RatioSpec(
                burst.name,
                metric,
                "on",
                "on_no_share",
                f"{label}, in-flight sharing on / off (prefix caching on)",
            )
        )
    return Comparison(
        name="prefix_cache",
        title="Prefix caching on vs off",
        question=(
            "On requests that share long system prompts, how much of the prompt does the "
            "prefix cache serve, and what does that do to time to first token? When they "
            "arrive together, what does waiting for a prefix still being prefilled "
            "(share_inflight_prefill) gain over computing it again?"
        ),
        base=base_config(s, [workload, burst]),
        workloads=[workload, burst],
        arms=[
            Arm("off", "prefix caching off"),
            Arm("on", "prefix caching on", {"enable_prefix_caching": True}),
            Arm(
                "on_no_share",
                "prefix caching on, no in-flight sharing",
                {"enable_prefix_caching": True, "share_inflight_prefill": False},
            ),
        ],
        ratios=ratios,
        plot_metrics=["prefix_hit_rate", "ttft_ms_p50", "ttft_ms_p99", "output_tokens_per_s"],
        skip=frozenset({(workload.name, "on_no_share")}),
        notes=[
            f"shared_prefix: closed loop with {clients} clients (concurrency / 8). "
            f"shared_prefix_burst: the same requests with {burst.concurrency} clients, so they "
            "all arrive at once; a block is published only once its prompt finished prefill, "
            "so there every hit comes from a request that waited for a prefix in flight.",
        ],
    )
