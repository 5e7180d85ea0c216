"""What one run measured, and the metrics derived from it.

A backend fills a ``RunRecord`` (per-request timestamps + engine counters); ``run_metrics``
turns it into one flat dict of numbers (``None`` where a backend cannot measure something),
which is what the JSON report stores per run and what every ratio is computed from.
"""

from __future__ import annotations

import math
import os
import platform
import resource
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from services.worker.model.ouro import OuroModel

Metrics = dict[str, float | int | None]


@dataclass
class RequestRecord:
    arrival: float  # perf_counter: when the request was due (open loop) or sent (closed loop)
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_cached_tokens: int = 0
    exit_depths: list[int] = field(default_factory=list)
    shard: str = ""  # the engine shard it finished on (sharded runs)
    kind: str = ""  # the workload's class for it (RequestSpec.kind)
    # engine steps (in-process only) when it was sent, gave its first token, finished: a
    # schedule's own clock, the same in every repeat however busy the machine is
    sent_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None


@dataclass
class EngineCounters:
    """Counted at the model runner (in-process engine or the pipeline's worker)."""

    batches: int = 0
    decode_batches: int = 0  # batches with decode rows: each is one pass that carries them
    execute_s: float = 0.0  # time inside ModelRunner.execute
    core_passes: int = 0  # OuroModel.core_loop calls
    core_rows: int = 0  # hidden-state rows over all core passes (a decode row is one)
    runner_core_passes: int | None = None  # the runner's own counter, as a cross-check


@dataclass
class WasteCounters:
    """What KV pressure cost, from the scheduler's stats (``SchedulerStats``)."""

    preemptions: int = 0
    recomputed_prompt_tokens: int = 0
    recomputed_prompt_token_loops: int = 0  # the same in core rows (token x loop)
    recomputed_decode_loops: int = 0  # loops replayed to rebuild dropped generated tokens
    reserved_blocks: int = 0
    reserved_unused_blocks: int = 0  # reserved, never written (the request stopped early)


@dataclass
class RunRecord:
    start: float
    end: float
    requests: list[RequestRecord]
    counters: EngineCounters | None = None
    extra: Metrics = field(default_factory=dict)
    waste: WasteCounters | None = None
    # CPU seconds by process when the clock started and stopped (``cpu_per_batch``)
    cpu_before: dict[str, float] = field(default_factory=dict)
    cpu_after: dict[str, float] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def run_metrics(run: RunRecord) -> Metrics:
    reqs = run.requests
    wall = run.end - run.start
    out_tokens = sum(len(r.token_times) for r in reqs)
    prompt_tokens = sum(r.num_prompt_tokens for r in reqs)
    ttft = [r.token_times[0] - r.arrival for r in reqs if r.token_times]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    latency = [r.finish_time - r.arrival for r in reqs if r.finish_time is not None]
    depths = [d for r in reqs for d in r.exit_depths]
    m: Metrics = {
        "wall_s": wall,
        "num_requests": len(reqs),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": _div(out_tokens, wall),
        "requests_per_s": _div(len(reqs), wall),
        "ttft_ms_mean": _ms(_mean(ttft)),
        "itl_ms_mean": _ms(_mean(itl)),
        "latency_ms_p50": _ms(percentile(latency, 50)),
        "mean_exit_depth": _mean(depths),
        "prefix_hit_rate": _div(sum(r.num_cached_tokens for r in reqs), prompt_tokens),
    }
    for q in (50, 90, 99):
        m[f"ttft_ms_p{q}"] = _ms(percentile(ttft, q))
        m[f"itl_ms_p{q}"] = _ms(percentile(itl, q))
    # a closed loop's TTFTs are two populations: the requests sent together at the start
    # (they wait for one another's prefill) and those sent one by one later; the p50 of all
    # falls between them, so each is also reported on its own
    opening: list[float] = []
    later: list[float] = []
    for r in reqs:
        if r.token_times:
            (opening if r.arrival == run.start else later).append(r.token_times[0] - r.arrival)
    m["ttft_ms_opening_p50"] = _ms(percentile(opening, 50))
    m["ttft_ms_later_p50"] = _ms(percentile(later, 50))
    for kind in REQUEST_KINDS:
        m.update(_kind_metrics(kind, [r for r in reqs if r.kind == kind]))
    m.update(_counter_metrics(run.counters, wall, out_tokens, len(reqs)))
    m.update(_waste_metrics(run.waste, run.counters, out_tokens))
    if run.cpu_after:
        batches = run.counters.batches if run.counters is not None else 0
        m.update(cpu_per_batch(run.cpu_before, run.cpu_after, batches, wall))
    m.update(run.extra)
    return m


# request classes a workload may mark (RequestSpec.kind), each also measured on its own
REQUEST_KINDS = ("short", "long")
_KIND_MEASURES = (
    "ttft_ms_p50",
    "ttft_ms_p99",
    "latency_ms_mean",
    "latency_ms_p50",
    "latency_ms_max",
    "ttft_steps_p50",
    "ttft_steps_p99",
    "latency_steps_mean",
)
KIND_METRICS = tuple(f"{m}_{kind}" for kind in REQUEST_KINDS for m in _KIND_MEASURES)


def _kind_metrics(kind: str, reqs: list[RequestRecord]) -> Metrics:
    """TTFT and end-to-end latency (send to finished) of one class; None where it has none."""
    ttft = [r.token_times[0] - r.arrival for r in reqs if r.token_times]
    latency = [r.finish_time - r.arrival for r in reqs if r.finish_time is not None]
    return {
        f"ttft_ms_p50_{kind}": _ms(percentile(ttft, 50)),
        f"ttft_ms_p99_{kind}": _ms(percentile(ttft, 99)),
        f"latency_ms_mean_{kind}": _ms(_mean(latency)),
        f"latency_ms_p50_{kind}": _ms(percentile(latency, 50)),
        f"latency_ms_max_{kind}": _ms(max(latency, default=None)),
        **_kind_step_metrics(kind, reqs),
    }


def _kind_step_metrics(kind: str, reqs: list[RequestRecord]) -> Metrics:
    """The same in engine steps (None where a backend does not count them)."""
    ttft = [r.first_token_step - r.sent_step for r in reqs if _stepped(r, r.first_token_step)]
    latency = [r.finish_step - r.sent_step for r in reqs if _stepped(r, r.finish_step)]
    return {
        f"ttft_steps_p50_{kind}": percentile(ttft, 50),
        f"ttft_steps_p99_{kind}": percentile(ttft, 99),
        f"latency_steps_mean_{kind}": _mean(latency),
    }


def _stepped(r: RequestRecord, step: int | None) -> bool:
    return r.sent_step is not None and step is not None


# a process-per-service pipeline run: where each batch's time goes, µs per batch
BREAKDOWN_METRICS = (
    "sched_step_us",
    "sched_encode_us",
    "sched_publish_us",
    "sched_deliver_us",
    "worker_decode_us",
    "nats_round_trip_us",
)
# where a run's CPU went (``cpu_per_batch``): the in-process arms' engine process, or each
# process of a process-per-service pipeline and the bench's client
CPU_PROCESSES = (
    "engine",
    "worker",
    "scheduler",
    "admission",
    "prefix_cache",
    "nats_server",
    "client",
)
CPU_METRICS = ("cpu_cores_busy", *(f"cpu_us_per_batch_{p}" for p in CPU_PROCESSES))
# what a sharded run (services/bench/sharded.py) adds to its metrics
SHARD_METRICS = (
    "shard_imbalance",
    "control_cpu_us_per_token",
    "scheduler_cpu_us_per_step",
    "sim_device_ms_per_step",
    "scheduler_cpu_per_sim_pass",
)

WASTE_METRICS = (
    "preemptions",
    "recomputed_prompt_tokens",
    "recomputed_prompt_tokens_per_output_token",
    "recomputed_prompt_core_share",
    "recomputed_core_share",
    "recomputed_decode_loops",
    "reserved_unused_blocks",
    "reserved_unused_share",
)


def _waste_metrics(w: WasteCounters | None, c: EngineCounters | None, out_tokens: int) -> Metrics:
    if w is None:
        return dict.fromkeys(WASTE_METRICS)
    return {
        "preemptions": w.preemptions,
        "recomputed_prompt_tokens": w.recomputed_prompt_tokens,
        "recomputed_prompt_tokens_per_output_token": _div(w.recomputed_prompt_tokens, out_tokens),
        # shares of all core work (rows over every core pass) spent on prompt recompute, and
        # on prompt recompute plus the decode loops replayed after a preemption
        "recomputed_prompt_core_share": _div(
            w.recomputed_prompt_token_loops, c.core_rows if c else None
        ),
        "recomputed_core_share": _div(
            w.recomputed_prompt_token_loops + w.recomputed_decode_loops,
            c.core_rows if c else None,
        ),
        "recomputed_decode_loops": w.recomputed_decode_loops,
        "reserved_unused_blocks": w.reserved_unused_blocks,
        "reserved_unused_share": _div(w.reserved_unused_blocks, w.reserved_blocks),
    }


def _counter_metrics(
    c: EngineCounters | None, wall: float, out_tokens: int, num_requests: int
) -> Metrics:
    names = (
        "batches",
        "core_passes",
        "core_rows_per_pass",
        "core_passes_per_output_token",
        "decode_passes_per_decode_token",
        "execute_s",
        "execute_us_per_batch",
        "host_us_per_batch",
        "runner_core_passes",
    )
    if c is None:
        return dict.fromkeys(names)
    # every request's first token comes from prefill; the rest each need decode passes
    decode_tokens = out_tokens - num_requests
    return {
        "batches": c.batches,
        "core_passes": c.core_passes,
        "core_rows_per_pass": _div(c.core_rows, c.core_passes),
        "core_passes_per_output_token": _div(c.core_passes, out_tokens),
        "decode_passes_per_decode_token": _div(c.decode_batches, decode_tokens),
        "execute_s": c.execute_s,
        "execute_us_per_batch": _div(c.execute_s * 1e6, c.batches),
        # wall time not spent executing batches, per batch: scheduling, I/O, bus, idling
        "host_us_per_batch": _div((wall - c.execute_s) * 1e6, c.batches),
        "runner_core_passes": c.runner_core_passes,
    }


def own_cpu_s() -> float:
    """utime + stime of this process, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_per_batch(
    before: dict[str, float], after: dict[str, float], batches: int, wall_s: float
) -> dict[str, float | None]:
    """Where a run's CPU went: µs per batch of each process (``cpu_us_per_batch_<key>``),
    and ``cpu_cores_busy``, the CPU seconds of all of them per second of the run (on a
    machine with few cores, how close the deployment came to filling them). A process in
    only one of the snapshots (started or gone during the run) is unknown: None, and then
    so is the total."""
    keys = sorted(before.keys() | after.keys())
    used = {k: after[k] - before[k] if k in before and k in after else None for k in keys}
    out: dict[str, float | None] = {
        f"cpu_us_per_batch_{k.replace('-', '_')}": (
            s * 1e6 / batches if s is not None and batches else None
        )
        for k, s in used.items()
    }
    known = [s for s in used.values() if s is not None]
    whole = len(known) == len(used) and wall_s > 0
    out["cpu_cores_busy"] = sum(known) / wall_s if whole else None
    return out


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
            or None
        )
    except OSError:
        info["git_commit"] = None
    return info


def model_info(model: OuroModel, checkpoint: Path, size: str | None) -> dict[str, Any]:
    cfg = model.cfg
    return {
        "checkpoint": str(checkpoint),
        "size": size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
        "total_ut_steps": cfg.total_ut_steps,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
