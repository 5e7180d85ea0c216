"""The four comparisons: which workloads, which arms (engine configurations), which ratios.

An arm is a backend plus ``SchedulerConfig`` overrides on the comparison's base config, so
arms differ in exactly the settings under test. A ratio is ``metric(numerator arm) /
metric(denominator arm)`` on the same workload and the same repeat (or a difference, for
overheads), so every ratio comes from two runs that ran next to each other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.bench import workloads as wl
from services.bench.sharded import ShardSetup
from services.bench.workloads import Scale, TokenRange, Workload
from services.common.config import KVAdmission, ModelLimits, SchedulerConfig


class BackendKind(StrEnum):
    IN_PROCESS = "in-process"
    PIPELINE = "pipeline"  # a process per service
    PIPELINE_ONE_PROCESS = "pipeline-one-process"  # every service in the bench's process
    # the simulated device (passes timed as Ouro-1.4B's on an H200, no model computed): a
    # pass that leaves the CPU to the rest, as a GPU's does. Reported extras, never targets
    IN_PROCESS_SIM = "in-process-sim"
    PIPELINE_SIM = "pipeline-sim"  # a process per service, the worker on the sim device
    SHARDS = "shards"  # one OS process per service, N shards (services/bench/sharded.py)

    @property
    def simulated(self) -> bool:
        return self in (BackendKind.IN_PROCESS_SIM, BackendKind.PIPELINE_SIM)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    backend: BackendKind = BackendKind.IN_PROCESS
    shards: ShardSetup | None = None  # the SHARDS backend's deployment


@dataclass(frozen=True)
class Target:
    """Bounds the median of a ratio must fall in; either bound may be open."""

    text: str
    low: float | None = None
    high: float | None = None

    def reached(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)


@dataclass(frozen=True)
class RatioSpec:
    workload: str
    metric: str
    numerator: str
    denominator: str
    label: str
    difference: bool = False  # numerator - denominator instead of a ratio
    target: Target | None = None
    value: bool = False  # the numerator arm's metric itself (denominator unused)
    # the denominator's workload when it differs (scaling: N shards serve N x the clients)
    denominator_workload: str = ""


@dataclass
class Comparison:
    name: str
    title: str
    question: str
    base: SchedulerConfig
    workloads: list[Workload]
    arms: list[Arm]
    ratios: list[RatioSpec]
    plot_metrics: list[str]
    skip: frozenset[tuple[str, str]] = frozenset()  # (workload, arm) pairs not run
    # Offered loads as fractions of the lowest closed-loop capacity among the arms: each
    # workload is measured closed-loop per arm, then replaced by one open-loop (Poisson)
    # copy per load. Empty: the workloads run as given.
    loads: tuple[float, ...] = ()
    notes: list[str] = field(default_factory=list)

    def config(self, arm: Arm) -> SchedulerConfig:
        return dataclasses.replace(self.base, **arm.overrides)

    def open_at_loads(self, capacities: dict[str, float]) -> None:
        """Replaces each workload by its open-loop copies (one per load) and each ratio on
        it by one ratio per copy; ``capacities`` maps workload name -> requests/s."""
        workloads: list[Workload] = []
        ratios = [r for r in self.ratios if r.workload not in capacities]
        for w in self.workloads:
            if w.name not in capacities:
                workloads.append(w)
                continue
            for load in self.loads:
                name = f"{w.name}_load{round(load * 100)}"
                copy = w.with_rate(load * capacities[w.name], name=name)
                workloads.append(copy)
                ratios += [
                    dataclasses.replace(r, workload=copy.name)
                    for r in self.ratios
                    if r.workload == w.name
                ]
        self.workloads, self.ratios = workloads, ratios

    def keep_arms(self, names: set[str]) -> None:
        """Runs only the arms named (a time-boxed run); a ratio needs both of its arms."""
        self.arms = [a for a in self.arms if a.name in names]
        self.ratios = [
            r for r in self.ratios if r.numerator in names and (r.value or r.denominator in names)
        ]

    def cases(self) -> list[tuple[Workload, Arm]]:
        return [
            (w, a) for w in self.workloads for a in self.arms if (w.name, a.name) not in self.skip
        ]


@dataclass(frozen=True)
class BenchSettings:
    scale: Scale
    concurrency: int
    seed: int
    limits: ModelLimits
    quick: bool = False
    rate: float | None = None
    block_size: int = 16
    model_size: str | None = None  # toy / small / 1.4b; None: a checkpoint of the user's
    routing_kv_prefixes: float | None = None  # routing: prefixes' room per shard; None: default

    @property
    def vocab(self) -> TokenRange:
        # ids 1.. below the vocab (0 is EOS in the toy checkpoints; EOS ids are skipped anyway)
        return TokenRange(1, self.limits.vocab_size, self.limits.eos_token_ids)


# ---------------------------------------------------------------------- configs
def base_config(s: BenchSettings, workloads: list[Workload], **overrides: Any) -> SchedulerConfig:
    """Seats for every client, and KV for all of them at their longest, so no arm preempts."""
    seats = s.concurrency
    per_request = math.ceil(max(w.max_request_tokens for w in workloads) / s.block_size)
    planes = s.limits.total_ut_steps
    num_blocks = max(256, seats * per_request * planes + 64)
    return SchedulerConfig(
        max_num_seqs=seats, block_size=s.block_size, num_blocks=num_blocks, **overrides
    )


# ---------------------------------------------------------------------- comparisons
# WCPB's offered loads (fractions of capacity): a light one and a busy one
WCPB_LOADS = (0.35, 0.6)
# the engine defaults prefill as WCPB rows; arms compared against atomic prefill say so
ATOMIC_PREFILL = {"split_prefill": False, "wavefront_chunked_prefill": False}


def depth_batching(s: BenchSettings) -> Comparison:
    early = wl.chat_closed(s.scale, s.vocab, s.concurrency, wl.EARLY_EXIT, s.seed)
    forced = wl.chat_closed(s.scale, s.vocab, s.concurrency, wl.FORCED_DEPTH, s.seed)
    # Judged at the engine defaults (WCPB prefill: prompt rows share the decode passes;
    # async scheduling). Under atomic prefill each newcomer's prompt runs decode-free
    # PREFILL passes that both arms pay alike; that pair is reported against the same bound.
    goal = "refill >= 25% fewer core passes per output token than cohort (ratio <= 0.75)"
    where = f"at concurrency 32 (run at {s.concurrency})"
    target = Target(f"{goal} {where}, engine defaults", high=0.75)
    target_atomic = Target(f"{goal} {where}, atomic prefill", high=0.75)
    pairs = [  # (workload, numerator, denominator, target)
        (early, "refill", "cohort", target),
        (early, "refill_atomic", "cohort_atomic", target_atomic),
        (early, "refill", "serial", None),
        (forced, "refill", "cohort", None),
    ]
    ratios: list[RatioSpec] = []
    for w, num, den, tgt in pairs:
        ratios += [
            RatioSpec(
                w.name,
                "core_passes_per_output_token",
                num,
                den,
                f"core passes/token, {num} / {den}",
                target=tgt,
            ),
            RatioSpec(
                w.name,
                "decode_passes_per_decode_token",
                num,
                den,
                f"decode passes/decode token, {num} / {den}",
            ),
            RatioSpec(w.name, "output_tokens_per_s", num, den, f"tokens/s, {num} / {den}"),
        ]
    return Comparison(
        name="depth_batching",
        title="Continuous depth batching vs cohort batching vs one request at a time",
        question=(
            "Do rows at different depths sharing one core pass (refill) save passes and time "
            "over holding new tokens until a whole cohort exits (refill=False), and over "
            "serving one request at a time (max_num_seqs=1)? The forced-depth workload is the "
            "control: with every token at full depth, refill and cohort should match."
        ),
        base=base_config(s, [early, forced]),
        workloads=[early, forced],
        arms=[
            Arm("refill", "continuous depth batching (refill)", {"refill": True}),
            Arm("cohort", "cohort batching (refill=False)", {"refill": False}),
            Arm("serial", "one at a time (max_num_seqs=1)", {"max_num_seqs": 1}),
            Arm("refill_atomic", "refill, atomic prefill", {"refill": True, **ATOMIC_PREFILL}),
            Arm("cohort_atomic", "cohort, atomic prefill", {"refill": False, **ATOMIC_PREFILL}),
        ],
        ratios=ratios,
        plot_metrics=[
            "core_passes_per_output_token",
            "decode_passes_per_decode_token",
            "output_tokens_per_s",
            "core_rows_per_pass",
        ],
        # serial at fixed depth is 4 passes/token by construction; the forced-depth
        # control needs only the default pair
        skip=frozenset(
            {
                (forced.name, "serial"),
                (forced.name, "refill_atomic"),
                (forced.name, "cohort_atomic"),
            }
        ),
        notes=[
            "The target is judged at the engine defaults: prefill as WCPB rows, so every core "
            "pass is a depth-batched pass and the ratio measures refill alone. Under atomic "
            "prefill a newcomer's prompt runs in PREFILL batches whose passes carry no decode "
            "rows; both arms pay them alike, which pulls that ratio towards 1. It is reported "
            "against the same bound. 'decode passes/decode token' counts only the passes that "
            "carry decode rows.",
        ],
    )


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


def pipeline(s: BenchSettings) -> Comparison:
    # two requests per client (not the scale's default): six arms, and a lower share of
    # steady state weighs on both backends alike
    workload = wl.chat_closed(
        s.scale, s.vocab, s.concurrency, wl.EARLY_EXIT, s.seed, requests_per_client=2
    )
    # the bar: the bus must cost nothing the user can measure. A toy pass is a few
    # ms, like a 1.4B decode pass on a GPU; `small`'s passes are longer, so less is hidden
    small = s.model_size == "small"
    async_low = 0.97 if small else 0.95
    targets = {
        ("output_tokens_per_s", "sync"): Target("pipeline >= 0.85x in-process tokens/s", 0.85),
        ("output_tokens_per_s", "async"): Target(
            f"pipeline >= {async_low}x in-process tokens/s", async_low
        ),
        ("ttft_ms_p50", "async"): Target("pipeline TTFT p50 <= 1.15x in-process", high=1.15),
        ("host_us_per_batch", "async"): Target("bus overhead per step <= 150 µs", high=150.0),
    }
    ratios: list[RatioSpec] = []
    # (pipeline arm, in-process arm, mode, whether the gap's parts are reported too)
    for n, d, mode, parts in (
        ("pipeline", "in_process", "sync", True),
        ("pipeline_async", "in_process_async", "async", True),
        ("pipeline_1proc", "in_process", "sync, one process", False),
        ("pipeline_1proc_async", "in_process_async", "async, one process", False),
        ("pipeline_sim", "in_process_sim", "sync, SIMULATED H200 passes", False),
        ("pipeline_sim_async", "in_process_sim_async", "async, SIMULATED H200 passes", False),
    ):
        measures = [
            ("output_tokens_per_s", "tokens/s, pipeline / in-process", False),
            ("ttft_ms_p50", "TTFT p50, pipeline / in-process", False),
            ("host_us_per_batch", "bus overhead per step, µs (pipeline - in-process", True),
        ]
        if parts:  # where the rest of the gap is (README, "Pipeline")
            measures += [
                ("execute_us_per_batch", "time executing a batch, pipeline / in-process", False),
                ("ttft_ms_opening_p50", "TTFT p50 of the opening burst, pipeline / in-process",
                 False),
                ("ttft_ms_later_p50", "TTFT p50 after it, pipeline / in-process", False),
            ]  # fmt: skip
        for metric, label, difference in measures:
            text = f"{label}, {mode})" if difference else f"{label} ({mode})"
            ratios.append(
                RatioSpec(
                    workload.name,
                    metric,
                    n,
                    d,
                    text,
                    difference=difference,
                    target=targets.get((metric, mode)),
                )
            )
    asynchronous = {"async_scheduling": True}
    synchronous = {"async_scheduling": False}
    one_process = BackendKind.PIPELINE_ONE_PROCESS
    sim, sim_pipe = BackendKind.IN_PROCESS_SIM, BackendKind.PIPELINE_SIM
    return Comparison(
        name="pipeline",
        title="NATS pipeline vs in-process engine",
        question=(
            "What does spreading the step loop over NATS (admission, scheduler, worker, "
            "prefix-cache services on a real nats-server) cost against the in-process engine, "
            "on the same workload and model?"
        ),
        base=base_config(s, [workload]),
        workloads=[workload],
        arms=[
            Arm("in_process", "in-process engine (sync)", synchronous),
            Arm(
                "pipeline",
                "NATS pipeline, a process per service (sync)",
                synchronous,
                BackendKind.PIPELINE,
            ),
            Arm("in_process_async", "in-process engine (async)", asynchronous),
            Arm(
                "pipeline_async",
                "NATS pipeline, a process per service (async)",
                asynchronous,
                BackendKind.PIPELINE,
            ),
            Arm(
                "pipeline_1proc",
                "NATS pipeline, services in one process (sync)",
                synchronous,
                one_process,
            ),
            Arm(
                "pipeline_1proc_async",
                "NATS pipeline, services in one process (async)",
                asynchronous,
                one_process,
            ),
            Arm("in_process_sim", "in-process engine, simulated H200 (sync)", synchronous, sim),
            Arm("pipeline_sim", "NATS pipeline, simulated H200 (sync)", synchronous, sim_pipe),
            Arm(
                "in_process_sim_async",
                "in-process engine, simulated H200 (async)",
                asynchronous,
                sim,
            ),
            Arm(
                "pipeline_sim_async",
                "NATS pipeline, simulated H200 (async)",
                asynchronous,
                sim_pipe,
            ),
        ],
        ratios=ratios,
        plot_metrics=["output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "host_us_per_batch"],
        notes=[
            "`pipeline` arms run one OS process per service (`rlt service NAME`, as compose "
            "does) against a real nats-server, started fresh for every run and warmed up with "
            "two requests before the clock starts; `pipeline_1proc` arms run the four "
            "services in the bench's own process (an extra: torch and the bus then share one "
            "interpreter). Every process runs on the same cores as the in-process arm (no "
            "pinning: all of this machine's cores). The client timestamps events as they "
            "arrive. Bus overhead per step = (wall time not spent in ModelRunner.execute) / "
            "batches, pipeline minus in-process; with a process per service the scheduler "
            "works while the worker computes, so this is the worker's time between batches: "
            "waiting, and on the CPU its own receiving and publishing, which run between "
            "short batches (RLT_WORKER_INLINE_MAX_MS).",
            "`*_sim` arms (SIMULATED, extras without targets) run the same workload with no "
            "model: each batch takes the time a cost model of Ouro-1.4B on an H200 gives it "
            "(services/worker/sim.py), asleep, as a GPU pass leaves the CPU to the rest. "
            "They show the bus's cost when the pass does not compete for this machine's "
            "cores; their tokens are simulated, so only their timing means anything. The "
            "in-process engine is synchronous, so its sleep overlaps nothing (as an "
            "in-process engine's would on a GPU); over NATS the scheduler works meanwhile.",
            "CPU per batch, by process (a process per service; the in-process arms: the "
            "engine's own process) and cores busy (all of their CPU seconds per second of "
            "the run): how much of this machine's cores each arm needed.",
        ],
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


# ---------------------------------------------------------------------- shards
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


BUILDERS = {
    "depth_batching": depth_batching,
    "wcpb": wcpb,
    "pipeline": pipeline,
    "prefix_cache": prefix_cache,
    "kv_pressure": kv_pressure,
    "admission_bypass": admission_bypass,
    "routing": routing,
    "scaling": scaling,
}


class UnknownArmError(ValueError):
    """``--arms`` named an arm that none of the comparisons run has."""


def build_comparisons(
    names: list[str], settings: BenchSettings, arms: list[str] | None = None
) -> list[Comparison]:
    """The comparisons ``names``; with ``arms``, only those arms of each (a comparison left
    without arms is dropped). An arm no comparison has is an UnknownArmError: a typo must
    not quietly shrink a run."""
    comparisons = [BUILDERS[n](settings) for n in names]
    if arms is None:
        return comparisons
    known = {a.name for c in comparisons for a in c.arms}
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise UnknownArmError(
            f"unknown arm(s) {', '.join(unknown)}; the comparisons run have: "
            f"{', '.join(sorted(known))}"
        )
    for c in comparisons:
        c.keep_arms(set(arms))
    return [c for c in comparisons if c.arms]
