"""``rlt bench --only pipeline``: the NATS pipeline (the services on a real nats-server)
against the in-process engine."""

from __future__ import annotations

from services.bench import workloads as wl
from services.bench.comparison import (
    Arm,
    BackendKind,
    BenchSettings,
    Comparison,
    RatioSpec,
    Target,
    base_config,
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
