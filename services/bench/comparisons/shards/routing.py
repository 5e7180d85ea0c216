"""``rlt bench --only routing``: KV-aware routing over real shards, by prefix against
round-robin against one big shard."""

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
from services.bench.sharded import ShardSetup
from services.common.config import SchedulerConfig

ROUTING_PREFIXES = 8
ROUTING_TARGETS = {
    "hit_vs_one": Target("prefix router >= 0.9x the hit rate of one shard with all the KV", 0.9),
    "hit_vs_rr": Target("prefix router >= 2x round-robin's hit rate", low=2.0),
    "ttft_vs_rr": Target("prefix router TTFT p50 <= 0.6x round-robin's", high=0.6),
    "imbalance": Target("hot prefix: max/mean requests per shard <= 1.5", high=1.5),
}


def routing(s: BenchSettings) -> Comparison:
    n = 2 if s.quick else 4
    clients = max(n, s.concurrency)
    prefix_tokens, suffix, output = (32, (4, 8), (2, 4)) if s.quick else (256, (16, 32), (8, 16))
    num_requests = (4 if s.quick else 24) * ROUTING_PREFIXES
    shared = wl.prefix_groups(
        s.vocab,
        clients,
        s.seed,
        groups=ROUTING_PREFIXES,
        prefix_tokens=prefix_tokens,
        suffix=suffix,
        output=output,
        num_requests=num_requests,
        name="shared_prefix8",
    )
    hot = wl.prefix_groups(
        s.vocab,
        clients,
        s.seed,
        groups=ROUTING_PREFIXES,
        prefix_tokens=prefix_tokens,
        suffix=suffix,
        output=output,
        num_requests=num_requests,
        hot_share=0.75,
        name="hot_prefix",
    )
    # KV per shard: its share of the clients' own blocks, plus room for (by default) its
    # share of the prefixes: the shards together hold every prefix once, if routing keeps
    # each on one shard; one shard with n x that holds all eight
    bs, planes = s.block_size, s.limits.total_ut_steps
    prefix_blocks = math.ceil(prefix_tokens / bs)
    own_blocks = math.ceil((suffix[1] + output[1]) / bs) + 1
    room = s.routing_kv_prefixes or ROUTING_PREFIXES / n
    prefix_room = math.ceil(room * prefix_blocks)
    per_shard = planes * (math.ceil(clients / n) * own_blocks + prefix_room)
    base = SchedulerConfig(
        max_num_seqs=clients,
        block_size=bs,
        num_blocks=per_shard,
        enable_prefix_caching=True,
        async_scheduling=True,
    )

    def arm(name: str, label: str, shards: int, router: str) -> Arm:
        return Arm(
            name,
            label,
            {"num_blocks": per_shard * (n // shards)},
            BackendKind.SHARDS,
            ShardSetup(shards=shards, router=router),
        )

    t = ROUTING_TARGETS
    ratios = [
        RatioSpec(shared.name, "prefix_hit_rate", "prefix", "one_shard",
                  f"prefix hit rate, {n} shards (prefix router) / 1 shard with {n}x the KV",
                  target=t["hit_vs_one"]),
        RatioSpec(shared.name, "prefix_hit_rate", "prefix", "round_robin",
                  "prefix hit rate, prefix / round-robin", target=t["hit_vs_rr"]),
        RatioSpec(shared.name, "ttft_ms_p50", "prefix", "round_robin",
                  "TTFT p50, prefix / round-robin", target=t["ttft_vs_rr"]),
        RatioSpec(shared.name, "output_tokens_per_s", "prefix", "round_robin",
                  "tokens/s, prefix / round-robin"),
        RatioSpec(shared.name, "prefix_hit_rate", "prefix", "prefix",
                  "prefix hit rate, prefix router", value=True),
        RatioSpec(shared.name, "shard_imbalance", "prefix", "prefix",
                  "max/mean requests per shard, prefix router (8 even prefixes)", value=True),
        RatioSpec(hot.name, "shard_imbalance", "prefix", "prefix",
                  "max/mean requests per shard, prefix router, one hot prefix", value=True,
                  target=t["imbalance"]),
        RatioSpec(hot.name, "prefix_hit_rate", "prefix", "prefix",
                  "prefix hit rate, prefix router, one hot prefix", value=True),
    ]  # fmt: skip
    return Comparison(
        name="routing",
        title=f"KV-aware routing over {n} real shards: prefix vs round-robin vs one big shard",
        question=(
            f"With {n} engine shards behind one router and requests over {ROUTING_PREFIXES} "
            "long shared prefixes, does routing by cached prefix overlap (against load) keep "
            "the prefix hit rate of a single shard holding all the KV, and how much does it "
            "beat round-robin on hits and time to first token? With one hot prefix, does the "
            "load term keep the shards balanced?"
        ),
        base=base,
        workloads=[shared, hot],
        arms=[
            arm("prefix", f"{n} shards, prefix router", n, "prefix"),
            arm("round_robin", f"{n} shards, round-robin", n, "round-robin"),
            arm("one_shard", f"1 shard with {n}x the KV per shard", 1, "prefix"),
        ],
        ratios=ratios,
        plot_metrics=["prefix_hit_rate", "ttft_ms_p50", "output_tokens_per_s", "shard_imbalance"],
        skip=frozenset({(hot.name, "round_robin"), (hot.name, "one_shard")}),
        notes=[
            f"Every arm runs the services as OS processes (rlt service ... --shard i) on a real "
            f"nats-server. KV per shard: {per_shard} blocks of {bs} tokens ({planes} planes): "
            f"the shard's share of the {clients} clients' own blocks plus room for "
            f"{room:g} of the {ROUTING_PREFIXES} {prefix_tokens}-token prefixes"
            f"{'' if s.routing_kv_prefixes else ' (its share: together they hold each once)'}; "
            f"the one-shard arm has {n}x that.",
            "Hit rate = prompt tokens served from the prefix cache / all prompt tokens "
            "(the finished events' num_cached_tokens). Imbalance = the busiest shard's "
            "requests / the mean over the shards.",
        ],
    )
