"""``rlt bench --only scaling``: scale-out, real shards on this machine and simulated shards
beyond it."""

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

# a simulated pass is this many times Ouro-1.4B's on an H200 (services/worker/sim.py):
# long enough that eight schedulers' own CPU fits two cores
SIM_DILATION = 100.0
SIM_CLIENTS_PER_SHARD = 32


def scaling(s: BenchSettings) -> Comparison:
    quick = s.quick
    real_clients = s.concurrency
    # prompts long enough that a worker's time goes into its model, not into the fixed cost
    # of a pass (CPU, small model): what two cores can show of two shards
    real = wl.long_decode(s.vocab, real_clients, s.seed,
                          prompt=(16, 32) if quick else (96, 192),
                          output=(4, 8) if quick else (16, 32),
                          requests_per_client=2 if quick else 3, name="real_chat")  # fmt: skip
    sim_counts = (1, 2, 4) if quick else (1, 8, 32)
    sim_workloads = {
        n: wl.long_decode(
            s.vocab,
            SIM_CLIENTS_PER_SHARD * n,
            s.seed,
            prompt=(16, 48),
            output=(8, 16) if quick else (64, 128),
            # several per client: steady state, not one wave whose slowest request decides
            requests_per_client=1 if quick else 3,
            name=f"sim_x{n}",
        )
        for n in sim_counts
    }
    bs, planes = s.block_size, s.limits.total_ut_steps
    longest = max(w.max_request_tokens for w in [real, *sim_workloads.values()])
    blocks = planes * (math.ceil(longest / bs) + 1) * max(real_clients, SIM_CLIENTS_PER_SHARD)
    base = SchedulerConfig(
        max_num_seqs=max(real_clients, SIM_CLIENTS_PER_SHARD),
        block_size=bs,
        num_blocks=blocks,
        async_scheduling=True,
    )
    arms = [
        Arm("real1", "1 real shard", backend=BackendKind.SHARDS, shards=ShardSetup(1)),
        Arm("real2", "2 real shards", backend=BackendKind.SHARDS, shards=ShardSetup(2)),
    ]
    for n in sim_counts:
        arms.append(
            Arm(
                f"sim{n}",
                f"{n} simulated shard(s), pass time x{SIM_DILATION:g}",
                backend=BackendKind.SHARDS,
                shards=ShardSetup(n, device="sim", sim_dilation=SIM_DILATION),
            )
        )
    low, mid, top = sim_counts
    skip = {(real.name, f"sim{n}") for n in sim_counts}
    skip |= {(w.name, a.name) for w in sim_workloads.values() for a in arms}
    skip -= {(sim_workloads[n].name, f"sim{n}") for n in sim_counts}
    w = {n: sim_workloads[n].name for n in sim_counts}
    tps = "output_tokens_per_s"
    ratios = [
        RatioSpec(real.name, tps, "real2", "real1", "tokens/s, 2 real shards / 1 (2 cores)",
                  target=Target("2 real shards >= 1.5x one", low=1.5)),
        RatioSpec(w[mid], tps, f"sim{mid}", "sim1", f"tokens/s, {mid} sim shards / 1",
                  denominator_workload=w[low],
                  target=Target(f"{mid} sim shards >= {mid - 1}x one", low=mid - 1.0)),
        RatioSpec(w[mid], "control_cpu_us_per_token", f"sim{mid}", "sim1",
                  f"control-plane CPU per token (admission + index + NATS), {mid} / 1 sim shards",
                  denominator_workload=w[low],
                  target=Target("the shared control plane does not grow with shards", high=1.2)),
        RatioSpec(w[low], "scheduler_cpu_per_sim_pass", "sim1", "sim1",
                  "scheduler CPU per step / simulated H200 pass time (1 sim shard)", value=True),
        RatioSpec(w[mid], "scheduler_cpu_per_sim_pass", f"sim{mid}", f"sim{mid}",
                  f"scheduler CPU per step / simulated H200 pass time ({mid} sim shards)",
                  value=True),
        RatioSpec(w[top], tps, f"sim{top}", "sim1", f"tokens/s, {top} sim shards / 1",
                  denominator_workload=w[low]),
        RatioSpec(w[top], "control_cpu_us_per_token", f"sim{top}", "sim1",
                  f"control-plane CPU per token, {top} / 1 sim shards",
                  denominator_workload=w[low]),
    ]  # fmt: skip
    for comp in ("admission", "prefix_cache", "nats_server", "schedulers", "workers", "client"):
        ratios.append(
            RatioSpec(
                w[top],
                f"cpu_us_per_token_{comp}",
                f"sim{top}",
                f"sim{top}",
                f"CPU µs per token in {comp}, {top} sim shards",
                value=True,
            )
        )
    return Comparison(
        name="scaling",
        title="Scale-out: real shards on this machine, simulated shards beyond it",
        question=(
            "Does throughput grow with shards, and is the shared control plane (admission "
            "with its router, the prefix index, NATS) what limits it? Real shards measure "
            "this machine; simulated shards (no model, a cost model of Ouro-1.4B on an H200, "
            f"dilated x{SIM_DILATION:g}) measure the control plane alone at 1 to {top} shards, "
            f"{SIM_CLIENTS_PER_SHARD} clients per shard."
        ),
        base=base,
        workloads=[real, *sim_workloads.values()],
        arms=arms,
        ratios=ratios,
        plot_metrics=[tps, "control_cpu_us_per_token", "scheduler_cpu_us_per_step"],
        skip=frozenset(skip),
        notes=[
            "SIMULATED: the sim arms run no model. A pass takes the time services/worker/sim.py "
            "gives for its rows (Ouro-1.4B bf16 weights + KV read per pass at 4.8 TB/s, "
            f"compute at 989 TFLOP/s) x {SIM_DILATION:g}; tokens and exit depths are a function "
            "of (seed, position). Their numbers describe the control plane, not a model.",
            "Control-plane CPU = CPU time of the admission, prefix-cache and nats-server "
            "processes over the run / output tokens. Scheduler CPU per step = the schedulers' "
            "CPU time / their steps; divided by the undilated simulated pass time per step it "
            "says how many cores a scheduler needs to keep one H200 busy.",
        ],
    )
