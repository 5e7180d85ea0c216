"""``rlt bench``: runs the selected comparisons, arms interleaved repeat by repeat, and
writes the report (JSON, markdown, PNGs).

Order of runs within a comparison: for each repeat, every (workload, arm) once, in the same
order (A B A B ...), so slow drift of a noisy machine lands on every arm alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.bench.analysis import arm_summary, ratio_result
from services.bench.backends import Backend, InProcessBackend
from services.bench.comparison import Arm, BackendKind, BenchSettings, Comparison
from services.bench.comparisons import overload, scheduler_step, sparse_prefill
from services.bench.comparisons.registry import UnknownArmError, build_comparisons
from services.bench.metrics import (
    BREAKDOWN_METRICS,
    CPU_METRICS,
    KIND_METRICS,
    SHARD_METRICS,
    WASTE_METRICS,
    machine_info,
    model_info,
    run_metrics,
)
from services.bench.progress import Progress
from services.bench.workloads import FULL, QUICK, Workload, warmup_workload
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import model_limits
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import ensure_checkpoint

SCHEMA = "rlt-bench/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUMMARY_METRICS = (
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "ttft_ms_opening_p50",
    "ttft_ms_later_p50",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_p99",
    "mean_exit_depth",
    "core_rows_per_pass",
    "core_passes_per_output_token",
    "decode_passes_per_decode_token",
    "prefix_hit_rate",
    "execute_us_per_batch",
    "host_us_per_batch",
    "wall_s",
    *WASTE_METRICS,
    *KIND_METRICS,
    "admission_bypasses",
    "admission_backfills",
    *BREAKDOWN_METRICS,
    *CPU_METRICS,
    *SHARD_METRICS,
)


class Bench:
    """Owns the backends (the model is loaded once; nats-server starts on first use)."""

    def __init__(self, checkpoint: Path, device: str, dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.device = device
        self.dtype = dtype
        self.model = OuroModel.from_checkpoint(checkpoint, dtype=dtype, device=device)
        codec = TextCodec.from_checkpoint(checkpoint)
        self._backends: dict[BackendKind, Backend] = {
            BackendKind.IN_PROCESS: InProcessBackend(self.model, codec=codec),
            BackendKind.IN_PROCESS_SIM: InProcessBackend(self.model, codec=codec, simulated=True),
        }

    def backend(self, kind: BackendKind) -> Backend:
        if kind not in self._backends:
            if kind is BackendKind.SHARDS:
                from services.bench.sharded import ShardedBackend

                self._backends[kind] = ShardedBackend(
                    self.checkpoint, device=self.device, dtype=self.dtype
                )
            else:
                from services.bench.pipeline import PipelineBackend  # nats only when needed

                self._backends[kind] = PipelineBackend(
                    self.checkpoint,
                    device="sim" if kind.simulated else self.device,
                    dtype=self.dtype,
                    processes=kind in (BackendKind.PIPELINE, BackendKind.PIPELINE_SIM),
                )
        return self._backends[kind]

    def run(self, workload: Workload, config: SchedulerConfig, arm: Arm) -> dict[str, Any]:
        gc.collect()
        backend = self.backend(arm.backend)
        if arm.shards is not None:
            record = backend.run(workload, config, arm.shards)  # type: ignore[call-arg]
        else:
            record = backend.run(workload, config)
        return run_metrics(record)

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()


def resolve_checkpoint(args: argparse.Namespace) -> Path:
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not (path / "config.json").exists():
            raise SystemExit(f"rlt bench: no config.json in checkpoint dir {path}")
        return path
    if args.size == "1.4b":
        if args.device == "cpu":
            print(
                "rlt bench: the 1.4b checkpoint is meant for a GPU (--device cuda --dtype "
                "bfloat16); on a CPU a run takes hours",
                file=sys.stderr,
            )
        print(
            "rlt bench: writing the 1.4b random checkpoint once (2.9 GB, about 20 s) "
            "unless it is cached",
            file=sys.stderr,
        )
    return ensure_checkpoint(None, size=args.size)


def _calibrate(bench: Bench, comparison: Comparison, progress: Progress) -> dict[str, Any]:
    """Measures each workload's closed-loop capacity per arm, then opens the workloads at
    the comparison's loads (fractions of the lowest capacity: loads every arm can carry)."""
    out: dict[str, Any] = {}
    lowest: dict[str, float] = {}
    for workload in comparison.workloads:
        capacity: dict[str, float] = {}
        for arm in comparison.arms:
            progress.describe(f"{comparison.name}: calibrating {workload.name}:{arm.name}")
            metrics = bench.run(workload, comparison.config(arm), arm)
            capacity[arm.name] = float(metrics["requests_per_s"] or 0.0)
            progress.advance()
        lowest[workload.name] = min(capacity.values())
        out[workload.name] = {"closed_loop_requests_per_s": capacity}
    comparison.open_at_loads(lowest)
    for w in comparison.workloads:
        base = w.name.rsplit("_load", 1)[0]
        if base in out and w.rate is not None:
            out[base].setdefault("loads", []).append(
                {"workload": w.name, "utilization": w.rate / lowest[base], "rate": w.rate}
            )
    return out


def run_comparison(
    bench: Bench, comparison: Comparison, repeats: int, progress: Progress
) -> dict[str, Any]:
    calibration = _calibrate(bench, comparison, progress) if comparison.loads else {}
    workloads = {w.name: w for w in comparison.workloads}
    warmed: set[BackendKind] = set()
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for workload, arm in comparison.cases():
            workload = workloads[workload.name]
            config = comparison.config(arm)
            # first use pays one-off costs outside the timing (a sharded run starts fresh
            # processes every time: nothing to warm)
            if arm.backend not in warmed and arm.backend is not BackendKind.SHARDS:
                whole = bench.device.startswith("cuda")
                bench.run(warmup_workload(workload, whole), config, arm)
                warmed.add(arm.backend)
            progress.describe(
                f"{comparison.name} r{repeat + 1}/{repeats} {workload.name}:{arm.name}"
            )
            metrics = bench.run(workload, config, arm)
            runs.append(
                {"workload": workload.name, "arm": arm.name, "repeat": repeat, "metrics": metrics}
            )
            progress.advance()
    return {
        "name": comparison.name,
        "title": comparison.title,
        "question": comparison.question,
        "notes": comparison.notes,
        "workloads": [w.summary() for w in comparison.workloads],
        "calibration": calibration,
        "base_config": _config_dict(comparison.base),
        "arms": [
            {
                "name": a.name,
                "label": a.label,
                "backend": str(a.backend),
                "overrides": {k: _plain(v) for k, v in a.overrides.items()},
                "config": _config_dict(comparison.config(a)),
                "shards": dataclasses.asdict(a.shards) if a.shards else None,
                # the sim device's numbers describe the control plane, not a model
                "simulated": a.backend.simulated or bool(a.shards and a.shards.simulated),
            }
            for a in comparison.arms
        ],
        "skipped": sorted([list(p) for p in comparison.skip]),
        "plot_metrics": comparison.plot_metrics,
        "runs": runs,
        "ratios": [ratio_result(spec, runs, repeats) for spec in comparison.ratios],
        "summary": arm_summary(comparison, runs, SUMMARY_METRICS),
    }


def failed_comparison(comparison: Comparison, exc: Exception) -> dict[str, Any]:
    return {
        "name": comparison.name,
        "title": comparison.title,
        "question": comparison.question,
        "error": f"{type(exc).__name__}: {exc}",
        "runs": [],
        "ratios": [],
    }


def _plain(value: Any) -> Any:
    return value if isinstance(value, int | float | bool) else str(value)


def _config_dict(config: SchedulerConfig) -> dict[str, Any]:
    return {k: _plain(v) for k, v in dataclasses.asdict(config).items()}


def command_line(args: argparse.Namespace) -> str:
    parts = ["rlt", "bench"]
    if args.quick:
        parts.append("--quick")
    if args.checkpoint:
        parts += ["--checkpoint", str(args.checkpoint)]
    else:
        parts += ["--size", args.size]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    parts += ["--repeats", str(args.repeats), "--concurrency", str(args.concurrency)]
    parts += ["--seed", str(args.seed)]
    if args.rate is not None:
        parts += ["--rate", f"{args.rate:g}"]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    if args.routing_kv_prefixes is not None:
        parts += ["--routing-kv-prefixes", f"{args.routing_kv_prefixes:g}"]
    if sorted(args.only) != sorted(_all_names()):
        parts += ["--only", ",".join(args.only)]
    if args.arms:
        parts += ["--arms", ",".join(args.arms)]
    parts += ["--out", str(args.out)]
    return " ".join(parts)


def _all_names() -> tuple[str, ...]:
    from services.bench.args import COMPARISON_NAMES

    return COMPARISON_NAMES


# comparisons with their own runner (not ``Comparison``s)
def _standalone(
    name: str, title: str, run: Callable[[], dict[str, Any]], kind: str | None = None
) -> dict[str, Any]:
    """A comparison run by its own module; one that breaks reports its error, as a broken
    comparison of the table does, so the others still report."""
    try:
        return run()
    except Exception as exc:
        failed: dict[str, Any] = {"name": name, "title": title, "question": "", "notes": []}
        if kind is not None:
            failed["kind"] = kind
        return {**failed, "error": f"{type(exc).__name__}: {exc}", "runs": [], "ratios": []}


STANDALONE = (
    "scheduler",
    "overload",
    "sparse_prefill",
    "disaggregation",
    "kv_codec",
    "speculative",
)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Runs everything and returns the results document (also what the JSON holds)."""
    threads = args.threads or (1 if args.device == "cpu" else None)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        # with more threads than free cores, each op's barrier waits out another process's
        # time slice; on a shared machine one thread per process is far steadier
        torch.set_num_threads(threads)
    try:
        return _run_bench(args)
    finally:
        torch.set_num_threads(saved_threads)  # callers (tests) keep their own setting


def _run_bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    checkpoint = resolve_checkpoint(args)
    bench = Bench(checkpoint, args.device, DTYPES[args.dtype])
    settings = BenchSettings(
        scale=QUICK if args.quick else FULL,
        concurrency=args.concurrency,
        seed=args.seed,
        limits=model_limits(bench.model),
        quick=args.quick,
        rate=args.rate,
        model_size=None if args.checkpoint else args.size,
        routing_kv_prefixes=args.routing_kv_prefixes,
    )
    try:
        comparisons = build_comparisons(
            [n for n in args.only if n not in STANDALONE], settings, arms=args.arms
        )
    except UnknownArmError:
        bench.close()
        raise
    total = sum(
        len(c.cases()) * args.repeats * max(1, len(c.loads))
        + (len(c.workloads) * len(c.arms) if c.loads else 0)
        for c in comparisons
    )
    if "overload" in args.only:
        total += overload.num_runs(args.repeats, args.quick)
    if "sparse_prefill" in args.only:
        total += sparse_prefill.num_runs(args.repeats, args.quick)
    if "speculative" in args.only:
        from services.bench.comparisons import speculative

        total += speculative.num_runs(args.quick)
    progress = Progress(total, enabled=not args.no_progress)
    results: list[dict[str, Any]] = []
    try:
        for c in comparisons:
            try:
                results.append(run_comparison(bench, c, args.repeats, progress))
            except Exception as exc:  # one broken comparison must not discard the others
                results.append(failed_comparison(c, exc))
        model_label = f"{settings.model_size or 'checkpoint'} model, {args.device}"
        # the comparisons on this machine's model (and the simulated device), by module
        for module, name, title in (
            (overload, "overload", "Overload"),
            (sparse_prefill, "sparse_prefill", "Token-sparse prefill"),
        ):
            if name in args.only:
                run = functools.partial(
                    module.run_comparison,
                    bench.model,
                    settings.vocab,
                    repeats=args.repeats,
                    seed=args.seed,
                    quick=args.quick,
                    model_label=model_label,
                    progress=progress,
                )
                results.append(_standalone(name, title, run))
        if "speculative" in args.only:
            results.append(
                _standalone(
                    "speculative",
                    "Self-speculative decoding",
                    lambda: speculative.run_comparison(
                        bench.model, checkpoint, seed=args.seed, quick=args.quick,
                        model_label=model_label, progress=progress,
                    ),
                    kind="speculative",
                )
            )  # fmt: skip
        if "kv_codec" in args.only:
            from services.bench.comparisons import kv_codec

            results.append(
                _standalone(
                    "kv_codec",
                    "KV codecs",
                    lambda: kv_codec.run_comparison(bench.model, quick=args.quick),
                )
            )
        if "scheduler" in args.only:
            steps = 200 if args.quick else 2000
            results.append(scheduler_step.run_comparison(args.repeats, steps=steps))
        if "disaggregation" in args.only:
            from services.bench.comparisons import (
                disaggregation,  # NIXL and processes: only when asked
            )

            results.append(
                _standalone(
                    "disaggregation",
                    "Prefill/decode disaggregation",
                    lambda: disaggregation.run_comparison(
                        args.repeats, seed=args.seed, quick=args.quick
                    ),
                    kind="disaggregation",
                )
            )
    finally:
        progress.close()
        bench.close()
    targets = [{"comparison": c["name"], **r} for c in results for r in c["ratios"] if r["target"]]
    return {
        "schema": SCHEMA,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(args),
        "settings": {
            "quick": args.quick,
            "repeats": args.repeats,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "rate": args.rate,
            "routing_kv_prefixes": args.routing_kv_prefixes,
            "interleaving": "each repeat runs every (workload, arm) once, in a fixed order "
            "(A B A B ...)",
        },
        "machine": machine_info(args.device),
        "model": model_info(bench.model, checkpoint, None if args.checkpoint else args.size),
        "elapsed_s": time.perf_counter() - started,
        "comparisons": results,
        "targets": targets,
    }


def main_bench(args: argparse.Namespace) -> int:
    from services.runtime.logging import configure_logging

    # the services log every request at info; a benchmark wants its progress bar
    configure_logging(os.environ.get("RLT_LOG_LEVEL", "warning"))
    from services.bench.report import targets_markdown, write_report

    try:
        results = run_bench(args)
    except UnknownArmError as exc:  # --arms named an arm no comparison run has
        print(f"rlt bench: {exc}", file=sys.stderr)
        return 2
    paths = write_report(results, Path(args.out), plots=not args.no_plots)
    print(targets_markdown(results))
    print("\nwrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    failed = [c for c in results["comparisons"] if c.get("error")]
    for c in failed:
        print(f"rlt bench: {c['name']} failed: {c['error']}", file=sys.stderr)
    return 1 if failed else 0
