"""What a comparison is: which workloads, which arms (engine configurations), which ratios.

An arm is a backend plus ``SchedulerConfig`` overrides on the comparison's base config, so
arms differ in exactly the settings under test. A ratio is ``metric(numerator arm) /
metric(denominator arm)`` on the same workload and the same repeat (or a difference, for
overheads), so every ratio comes from two runs that ran next to each other. The comparisons
themselves are ``comparisons/``, one module each.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.bench.sharded import ShardSetup
from services.bench.workloads import Scale, TokenRange, Workload
from services.common.config import ModelLimits, SchedulerConfig


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


# the engine defaults prefill as WCPB rows; arms compared against atomic prefill say so
ATOMIC_PREFILL = {"split_prefill": False, "wavefront_chunked_prefill": False}
