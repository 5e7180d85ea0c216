"""``rlt bench --only overload``: shedding depth (``--overload-policy shed-depth``) against
refusing alone, under open-loop overload, on this machine's model and on the simulated H200.

Per device, all measured in the same run:

1. an unloaded run (one client, closed loop) states the SLO: a request meets it when its
   TTFT is within ``TTFT_SLO_FACTOR`` x the unloaded TTFT p99 and its own ITL p99 within
   ``ITL_SLO_FACTOR`` x the unloaded ITL p99;
2. the capacity: a closed loop with a client per seat (no queue forms, so neither arm
   sheds), in requests/s while every seat was busy (``steady_throughput``);
3. Poisson arrivals at each of ``LOADS`` x that capacity (the same arrival times for both
   arms), each arm once per repeat, arms interleaved. An arrival that finds
   ``MAX_WAITING_PER_SEAT`` x seats requests already queued is refused, as admission's
   ``max_waiting_requests`` refuses it (``overloaded``), emulated in process.

Per run: goodput (requests within the SLO per second of the run), the refused fraction, the
mean loops per generated decode token, the share of tokens run under a shed budget, and a
digest of every request's tokens and exit depths (the arms' tokens are identical when the
digests are).

Every time here is read from a ``VirtualClock``: this process's CPU time, plus the simulated
device's time on the sim arm, plus the idle gaps it skips while waiting for the next
arrival. On the shared machine this bench is run on, other jobs take turns on the same
cores; wall time would charge their turns to whichever arm happened to run, CPU time does
not (the engine runs in this one thread: torch is held to one thread on the CPU).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench.analysis import per_repeat_result
from services.bench.comparisons.open_loop import (
    Outcome,
    Slo,
    VirtualClock,
    drive,
    run_metrics,
    steady_throughput,
)
from services.bench.progress import Progress
from services.bench.workloads import LengthMix, RequestSpec, TokenRange, poisson_arrivals
from services.common.config import OverloadPolicy, SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.sim import SimRunner

LOADS = (0.8, 1.2, 1.5, 2.0)
# the SLO, as multiples of the unloaded run's p99s (see the module docstring)
TTFT_SLO_FACTOR = 10.0
ITL_SLO_FACTOR = 5.0
# admission's queue limit in this bench: one queued request per seat
MAX_WAITING_PER_SEAT = 1
UNLOADED_REQUESTS = 12
ARMS = {"reject": OverloadPolicy.REJECT, "shed": OverloadPolicy.SHED_DEPTH}
# simulated passes take this many times an H200's: the device, not this machine's CPU (the
# in-process engine schedules between passes, never during one), is then what saturates
SIM_DILATION = 10.0
# the loads the targets are judged at
GOODPUT_LOAD, IDENTICAL_LOAD = 1.5, 0.8


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    simulated: bool
    seats: int
    requests: int  # per open-loop run (and the capacity run)
    lengths: LengthMix


def devices(quick: bool, model_label: str) -> list[Device]:
    if quick:
        mix = LengthMix(prompt=(4, 8), output=(4, 8))
        return [
            Device("model", model_label, False, 2, 8, mix),
            Device("sim", "simulated H200 (Ouro-1.4B passes)", True, 4, 16, mix),
        ]
    # short answers, so a run spans several request lifetimes: the overload is steady, not
    # the ramp of the first lifetime; decode-heavy, since only decode tokens can be shed
    return [
        Device("model", model_label, False, 16, 128, LengthMix(prompt=(8, 24), output=(16, 32))),
        Device(
            "sim",
            f"simulated H200 (Ouro-1.4B passes x{SIM_DILATION:g}, SIMULATED)",
            True,
            64,
            512,
            LengthMix(prompt=(16, 48), output=(16, 32)),
        ),
    ]


def _specs(device: Device, vocab: TokenRange, seed: int) -> list[RequestSpec]:
    rng = random.Random(f"{seed}:overload:{device.name}")
    return [device.lengths.draw(rng, vocab) for _ in range(device.requests)]


class OverloadBench:
    def __init__(self, model: OuroModel, vocab: TokenRange, block_size: int = 16) -> None:
        self.model = model
        self.vocab = vocab
        self.block_size = block_size

    def config(
        self, device: Device, specs: list[RequestSpec], policy: OverloadPolicy
    ) -> SchedulerConfig:
        longest = max(s.num_prompt_tokens + s.max_tokens for s in specs)
        planes = self.model.cfg.total_ut_steps
        # KV for every seat at its longest: the queue, not KV, is what overloads
        blocks = device.seats * (-(-longest // self.block_size) + 1) * planes + 64
        return SchedulerConfig(
            max_num_seqs=device.seats,
            block_size=self.block_size,
            num_blocks=blocks,
            overload_policy=policy,
        )

    def engine(self, device: Device, config: SchedulerConfig) -> tuple[LLMEngine, VirtualClock]:
        sim = None
        if device.simulated:
            sim = SimRunner.h200(self.model.cfg, dilation=SIM_DILATION)
            sim.sleep = False  # the clock adds the device time the cost model charged
        return LLMEngine(self.model, config, simulated=sim), VirtualClock(sim)

    def run(
        self, device: Device, specs: list[RequestSpec], policy: OverloadPolicy, **how: Any
    ) -> tuple[list[Outcome], float]:
        engine, clock = self.engine(device, self.config(device, specs, policy))
        return drive(engine, clock, specs, **how)


def run_comparison(
    model: OuroModel,
    vocab: TokenRange,
    *,
    repeats: int,
    seed: int,
    quick: bool,
    model_label: str,
    progress: Progress,
) -> dict[str, Any]:
    bench = OverloadBench(model, vocab)
    runs: list[dict[str, Any]] = []
    calibration: dict[str, Any] = {}
    for device in devices(quick, model_label):
        specs = _specs(device, vocab, seed)
        # untimed first use (kernels, allocators), then the unloaded run and the capacity
        bench.run(device, specs[:2], OverloadPolicy.REJECT, concurrency=2)
        progress.describe(f"overload {device.name}: unloaded run and capacity")
        unloaded = specs[:UNLOADED_REQUESTS]
        outcomes, wall = bench.run(device, unloaded, OverloadPolicy.REJECT, concurrency=1)
        base = run_metrics(outcomes, wall, None)
        slo = Slo(
            ttft_s=TTFT_SLO_FACTOR * base["ttft_ms_p99"] / 1e3,
            itl_s=ITL_SLO_FACTOR * base["itl_ms_p99"] / 1e3,
        )
        outcomes, wall = bench.run(device, specs, OverloadPolicy.REJECT, concurrency=device.seats)
        capacity = steady_throughput(outcomes)
        progress.advance()
        calibration[device.name] = {
            "label": device.label,
            "simulated": device.simulated,
            "seats": device.seats,
            "requests": device.requests,
            "prompt_tokens": list(device.lengths.prompt),
            "output_tokens": list(device.lengths.output),
            "max_waiting": MAX_WAITING_PER_SEAT * device.seats,
            "unloaded": base,
            "slo_ttft_ms": slo.ttft_s * 1e3,
            "slo_itl_ms": slo.itl_s * 1e3,
            "capacity_requests_per_s": capacity,
        }
        for repeat in range(repeats):
            for load in LOADS:
                rate = load * capacity
                rng = random.Random(f"{seed}:overload:{device.name}:arrivals")
                arrivals = poisson_arrivals(len(specs), rate, rng)
                for arm, policy in ARMS.items():
                    progress.describe(
                        f"overload r{repeat + 1}/{repeats} {device.name} x{load} {arm}"
                    )
                    outcomes, wall = bench.run(
                        device,
                        specs,
                        policy,
                        arrivals=arrivals,
                        max_waiting=MAX_WAITING_PER_SEAT * device.seats,
                    )
                    metrics = run_metrics(outcomes, wall, slo)
                    runs.append(
                        {
                            "device": device.name,
                            "load": load,
                            "arm": arm,
                            "repeat": repeat,
                            "rate": rate,
                            "metrics": metrics,
                        }
                    )
                    progress.advance()
    return {
        "name": "overload",
        "kind": "overload",
        "title": "Overload: shed depth (shed-depth) vs refuse only (reject)",
        "question": (
            "Under open-loop arrivals beyond capacity, does lowering the loops per generated "
            "token serve more requests within an SLO than refusing alone, at what depth, and "
            "does it leave the tokens alone under capacity?"
        ),
        "notes": notes(),
        "calibration": calibration,
        "runs": runs,
        "ratios": ratios(runs, repeats, list(calibration)),
    }


def num_runs(repeats: int, quick: bool) -> int:
    """Progress steps of ``run_comparison``."""
    return len(devices(quick, "")) * (1 + repeats * len(LOADS) * len(ARMS))


def notes() -> list[str]:
    return [
        "Workload: greedy chat requests (ignore_eos), the API's exit defaults (fixed depth "
        "4 loops, min_loops 2); the same prompts, lengths and Poisson arrival times for both "
        "arms. shed-depth runs with its defaults (floor 2 loops, shed while the queue holds "
        "half the running requests).",
        f"SLO per device, from its unloaded run (one client at a time): TTFT <= "
        f"{TTFT_SLO_FACTOR:g} x unloaded TTFT p99 and the request's own ITL p99 <= "
        f"{ITL_SLO_FACTOR:g} x unloaded ITL p99. Goodput = requests within the SLO / seconds "
        "from the first arrival to the last (the same for both arms at one load).",
        f"Refusals: an arrival that finds {MAX_WAITING_PER_SEAT} x seats requests waiting "
        "is refused (admission's max_waiting_requests, emulated in process).",
        "Mean loops per token: exit depths of the generated tokens after the first (that one "
        "comes from the full-depth prefill).",
        "Times are virtual (VirtualClock): this process's CPU seconds, plus the simulated "
        "device's seconds on the sim arm, with idle gaps between arrivals skipped, so other "
        "jobs on the shared cores do not move them.",
        "The sim device runs no model: each batch sleeps the time services/worker/sim.py's "
        f"cost model gives Ouro-1.4B's passes on an H200, x{SIM_DILATION:g} (without it this "
        "machine's CPU, scheduling between passes, would be what saturates; its times are "
        f"therefore {SIM_DILATION:g}x an H200's). Its tokens are a function of (seed, "
        "position), so only its timing and exit depths mean anything.",
    ]


def _per_repeat(
    runs: list[dict[str, Any]], device: str, load: float, arm: str, metric: str, repeats: int
) -> list[Any]:
    out = []
    for r in range(repeats):
        found = [
            x["metrics"][metric]
            for x in runs
            if (x["device"], x["load"], x["arm"], x["repeat"]) == (device, load, arm, r)
        ]
        out.append(found[0] if found else None)
    return out


def _ratio(
    label: str,
    device: str,
    load: float,
    metric: str,
    values: list[Any],
    target: tuple[str, float | None, float | None] | None = None,
) -> dict[str, Any]:
    return per_repeat_result(f"{device} x{load:g}", metric, label, "value", values, target)


def ratios(runs: list[dict[str, Any]], repeats: int, names: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for device in names:
        for load in LOADS:

            def get(arm: str, metric: str, device: str = device, load: float = load) -> list[Any]:
                return _per_repeat(runs, device, load, arm, metric, repeats)

            shed_good, reject_good = get("shed", "goodput_rps"), get("reject", "goodput_rps")
            goodput = [
                s / r if s is not None and r else None
                for s, r in zip(shed_good, reject_good, strict=True)
            ]
            judged = load == GOODPUT_LOAD and device == "model"
            out.append(
                _ratio(
                    "goodput, shed-depth / reject",
                    device,
                    load,
                    "goodput_ratio",
                    goodput,
                    ("shed-depth goodput >= 1.3x reject-only at 1.5x", 1.3, None)
                    if judged
                    else None,
                )
            )
            out.append(
                _ratio(
                    "mean loops per token, shed-depth",
                    device,
                    load,
                    "mean_loops_per_token",
                    get("shed", "mean_loops_per_token"),
                    ("mean loops per token >= 2.0 (of 4) at 1.5x", 2.0, None) if judged else None,
                )
            )
            for arm in ARMS:
                out.append(
                    _ratio(
                        f"refused fraction, {arm}",
                        device,
                        load,
                        "refused_fraction",
                        get(arm, "refused_fraction"),
                    )
                )
            same = [
                None if a is None or b is None else float(a == b)
                for a, b in zip(get("shed", "digest"), get("reject", "digest"), strict=True)
            ]
            out.append(
                _ratio(
                    "tokens and exit depths identical (1 = yes)",
                    device,
                    load,
                    "identical",
                    same,
                    ("at 0.8x both arms' tokens identical", 1.0, None)
                    if load == IDENTICAL_LOAD
                    else None,
                )
            )
    return out


# ---------------------------------------------------------------------- report
def markdown(c: dict[str, Any]) -> list[str]:
    lines = [f"## {c['title']}", "", c["question"], "", *(f"- {n}" for n in c["notes"]), ""]
    lines += [
        "| device | seats | capacity req/s | unloaded TTFT p99 ms | unloaded ITL p99 ms | "
        "SLO: TTFT ms | SLO: ITL p99 ms | refuse at queue |",
        "|" + "---|" * 8,
    ]
    for cal in c["calibration"].values():
        u = cal["unloaded"]
        lines.append(
            f"| {cal['label']} | {cal['seats']} | {cal['capacity_requests_per_s']:.1f} | "
            f"{u['ttft_ms_p99']:.1f} | {u['itl_ms_p99']:.1f} | {cal['slo_ttft_ms']:.0f} | "
            f"{cal['slo_itl_ms']:.0f} | {cal['max_waiting']} |"
        )
    lines += ["", "Per run, median over the repeats:", ""]
    cols = (
        "goodput_rps",
        "good_share",
        "refused_fraction",
        "mean_loops_per_token",
        "shed_token_share",
        "ttft_ms_p99",
        "itl_ms_p99",
        "requests_per_s",
    )
    lines += ["| device | load | arm | " + " | ".join(cols) + " |", "|" + "---|" * (3 + len(cols))]
    for (device, load, arm), rows in _grouped(c["runs"]).items():
        cells = []
        for col in cols:
            values = [r["metrics"][col] for r in rows if r["metrics"][col] is not None]
            cells.append(f"{statistics.median(values):.3g}" if values else "n/a")
        lines.append(f"| {device} | {load:g}x | {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| ratio | where | per repeat | median | target | reached |",
        "|---|---|---|---|---|---|",
    ]
    for r in c["ratios"]:
        per = ", ".join("n/a" if v is None else f"{v:.3g}" for v in r["per_repeat"])
        med = "n/a" if r["median"] is None else f"{r['median']:.3g}"
        target = r["target"]["text"] if r["target"] else ""
        reached = "" if r["target"] is None else ("**yes**" if r["reached"] else "**no**")
        lines.append(f"| {r['label']} | {r['workload']} | {per} | {med} | {target} | {reached} |")
    lines.append("")
    return lines


def _grouped(runs: list[dict[str, Any]]) -> dict[tuple[str, float, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["device"], r["load"], r["arm"]), []).append(r)
    return groups


def plot(c: dict[str, Any], path: Path) -> bool:
    """Goodput, refused fraction and mean loops per token against the offered load, one
    line per arm, one row per device; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    metrics = (
        ("goodput_rps", "goodput, req/s within SLO"),
        ("refused_fraction", "refused fraction"),
        ("mean_loops_per_token", "mean loops / token"),
    )
    devices_run = list(c["calibration"])
    fig, axes = plt.subplots(
        len(devices_run),
        len(metrics),
        figsize=(4.2 * len(metrics), 3.2 * len(devices_run)),
        squeeze=False,
    )
    groups = _grouped(c["runs"])
    for row, device in zip(axes, devices_run, strict=True):
        for ax, (metric, title) in zip(row, metrics, strict=True):
            for j, arm in enumerate(ARMS):
                xs, ys, lo, hi = [], [], [], []
                for load in LOADS:
                    values = [
                        r["metrics"][metric]
                        for r in groups.get((device, load, arm), [])
                        if r["metrics"][metric] is not None
                    ]
                    if values:
                        xs.append(load)
                        ys.append(statistics.median(values))
                        lo.append(ys[-1] - min(values))
                        hi.append(max(values) - ys[-1])
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=f"C{j}", label=arm)
            ax.set_title(f"{device}: {title}", fontsize=9)
            ax.set_xlabel("offered load / capacity")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    names = "; ".join(f"{d}: {c['calibration'][d]['label']}" for d in devices_run)
    fig.suptitle(f"{c['title']}\n{names}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
