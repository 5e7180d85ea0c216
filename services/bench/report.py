"""Writes a results document as ``results.json``, ``report.md`` and one PNG per comparison.

matplotlib is optional (a dev extra) and imported only here, with the Agg backend, so a
machine without a display or without matplotlib still gets the JSON and markdown.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.bench.metrics import CPU_METRICS, CPU_PROCESSES, SHARD_METRICS

METRIC_LABELS = {
    "output_tokens_per_s": "output tok/s",
    "requests_per_s": "req/s",
    "ttft_ms_p50": "TTFT p50 ms",
    "ttft_ms_p90": "TTFT p90 ms",
    "ttft_ms_p99": "TTFT p99 ms",
    "ttft_ms_mean": "TTFT mean ms",
    "itl_ms_p50": "ITL p50 ms",
    "itl_ms_p90": "ITL p90 ms",
    "itl_ms_p99": "ITL p99 ms",
    "mean_exit_depth": "mean exit depth",
    "core_rows_per_pass": "core rows/pass",
    "core_passes_per_output_token": "core passes/token",
    "decode_passes_per_decode_token": "decode passes/decode token",
    "prefix_hit_rate": "prefix hit rate",
    "host_us_per_batch": "host µs/batch",
    "execute_us_per_batch": "execute µs/batch",
    "ttft_ms_opening_p50": "TTFT p50 ms, opening burst",
    "ttft_ms_later_p50": "TTFT p50 ms, after it",
    "wall_s": "wall s",
    "preemptions": "preemptions",
    "recomputed_prompt_tokens": "recomputed prompt tokens",
    "recomputed_prompt_tokens_per_output_token": "recomputed prompt tok/output tok",
    "recomputed_prompt_core_share": "core share recomputing prompts",
    "recomputed_core_share": "core share recomputing (prompts + decode replays)",
    "recomputed_decode_loops": "replayed decode loops",
    "reserved_unused_blocks": "reserved unused blocks",
    "reserved_unused_share": "reserved unused share",
    "ttft_ms_p50_short": "short: TTFT p50 ms",
    "ttft_ms_p99_short": "short: TTFT p99 ms",
    "latency_ms_mean_short": "short: completion mean ms",
    "latency_ms_p50_short": "short: completion p50 ms",
    "latency_ms_max_short": "short: completion max ms",
    "ttft_ms_p50_long": "long: TTFT p50 ms",
    "ttft_ms_p99_long": "long: TTFT p99 ms",
    "latency_ms_mean_long": "long: completion mean ms",
    "latency_ms_p50_long": "long: completion p50 ms",
    "latency_ms_max_long": "long: completion max ms",
    "ttft_steps_p50_short": "short: TTFT p50, steps",
    "ttft_steps_p99_short": "short: TTFT p99, steps",
    "latency_steps_mean_short": "short: completion mean, steps",
    "ttft_steps_p50_long": "long: TTFT p50, steps",
    "ttft_steps_p99_long": "long: TTFT p99, steps",
    "latency_steps_mean_long": "long: completion mean, steps",
    "admission_bypasses": "admission bypasses (counted)",
    "admission_backfills": "admission backfills",
    "shard_imbalance": "max/mean requests per shard",
    "control_cpu_us_per_token": "control-plane CPU µs/token",
    "scheduler_cpu_us_per_step": "scheduler CPU µs/step",
    "sim_device_ms_per_step": "simulated H200 ms/step",
    "scheduler_cpu_per_sim_pass": "scheduler CPU / sim pass",
}
BREAKDOWN_LABELS = {
    "sched_step_us": "scheduler step",
    "sched_encode_us": "encode batch",
    "sched_publish_us": "publish batch",
    "sched_deliver_us": "client events",
    "worker_decode_us": "worker decode",
    "nats_round_trip_us": "NATS round trip",
}
CPU_LABELS = {
    "cpu_cores_busy": "cores busy",
    **{f"cpu_us_per_batch_{p}": p.replace("_", "-") for p in CPU_PROCESSES},
}
# shown only where some arm has a nonzero value (KV pressure), not as columns of zeros
WASTE_TABLE_METRICS = (
    "preemptions",
    "recomputed_prompt_tokens_per_output_token",
    "recomputed_prompt_core_share",
    "recomputed_core_share",
    "reserved_unused_share",
)
# likewise: per request class and admission order (workloads that mark long and short)
CLASS_TABLE_METRICS = (
    "ttft_ms_p50_short",
    "ttft_ms_p99_short",
    "latency_ms_mean_long",
    "latency_ms_max_long",
    "ttft_steps_p99_short",
    "latency_steps_mean_long",
    "admission_bypasses",
    "admission_backfills",
)
TABLE_METRICS = (
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_p99",
    "mean_exit_depth",
    "core_rows_per_pass",
    "core_passes_per_output_token",
    "decode_passes_per_decode_token",
    "prefix_hit_rate",
    "host_us_per_batch",
)


def fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:.0f}"
        return f"{x:.3g}"
    return str(x)


def _spread(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "n/a"
    if s["min"] == s["max"]:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['min'])}–{fmt(s['max'])}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _reached(value: bool | None) -> str:
    return {True: "**yes**", False: "**no**", None: "n/a"}[value]


def targets_markdown(results: dict[str, Any]) -> str:
    rows = [
        [
            f"{t['comparison']} ({t['workload']})",
            t["target"]["text"],
            f"{fmt(t['median'])} [{fmt(t['min'])}–{fmt(t['max'])}]",
            _reached(t["reached"]),
        ]
        for t in results["targets"]
    ]
    rows += [
        [c["name"], "(every target of this comparison)", f"failed: {c['error']}", "n/a"]
        for c in results["comparisons"]
        if c.get("error")
    ]
    header = ["comparison (workload)", "target", "measured ratio: median [min–max]", "reached"]
    return "\n".join(_table(header, rows))


def _workload_rows(workloads: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for w in workloads:
        load = f"x{w['concurrency']} clients" if w["mode"] == "closed" else f"{fmt(w['rate'])}/s"
        p, o = w["prompt_tokens"], w["output_tokens"]
        rows.append(
            [
                w["name"],
                w["description"],
                f"{w['mode']} ({load})",
                str(w["num_requests"]),
                f"{p['min']}–{p['max']} (Σ {p['total']})",
                f"{o['min']}–{o['max']} (Σ {o['total']})",
            ]
        )
    return rows


def comparison_markdown(c: dict[str, Any], repeats: int, plot: str | None) -> list[str]:
    if c.get("kind") == "microbench":
        from services.bench.comparisons.scheduler_step import markdown

        return markdown(c)
    if c.get("kind") == "disaggregation":
        from services.bench.comparisons import disaggregation

        return disaggregation.markdown(c)
    lines = [f"## {c['title']}", "", c["question"], ""]
    if c.get("error"):
        return [*lines, f"**Failed**: `{c['error']}`", ""]
    if c.get("kind") == "overload":
        from services.bench.comparisons import overload

        lines = overload.markdown(c)
        return [*lines, f"![{c['name']}]({plot})", ""] if plot else lines
    if c.get("kind") == "sparse_prefill":
        from services.bench.comparisons import sparse_prefill

        lines = sparse_prefill.markdown(c)
        return [*lines, f"![{c['name']}]({plot})", ""] if plot else lines
    lines += [f"- {n}" for n in c["notes"]]
    for name, cal in c["calibration"].items():
        caps = ", ".join(f"{arm} {fmt(v)}" for arm, v in cal["closed_loop_requests_per_s"].items())
        loads = ", ".join(
            f"`{x['workload']}` {fmt(x['rate'])} req/s ({x['utilization']:.0%})"
            for x in cal.get("loads", [])
        )
        lines.append(f"- `{name}` closed-loop capacity, req/s: {caps}; open-loop runs: {loads}")
    lines.append("")
    lines += _table(
        ["workload", "what", "arrivals", "requests", "prompt tokens", "output tokens"],
        _workload_rows(c["workloads"]),
    )
    lines.append("")
    lines += _table(
        ["arm", "what", "backend", "settings under test (over the shared ones)"],
        [
            [
                a["name"],
                a["label"] + (" **(SIMULATED device)**" if a.get("simulated") else ""),
                a["backend"],
                ", ".join(f"{k}={v}" for k, v in a["overrides"].items()) or "—",
            ]
            for a in c["arms"]
        ],
    )
    base = c["base_config"]
    shared = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "prefill_chunk_size",
        "block_size",
        "num_blocks",
        "kv_layout",
        "async_scheduling",
    )
    lines += [
        "",
        "Shared settings (before the arms' overrides): "
        + ", ".join(f"{k}={base[k]}" for k in shared)
        + ".",
        "",
        f"Per arm: median [min–max] over {repeats} repeat(s).",
        "",
    ]
    metrics = [
        m
        for m in TABLE_METRICS
        if any(row["stats"][m]["median"] is not None for row in c["summary"])
    ]
    metrics += [
        m
        for m in (*CLASS_TABLE_METRICS, *WASTE_TABLE_METRICS, *SHARD_METRICS)
        if any(row["stats"].get(m, {}).get("median") for row in c["summary"])
    ]
    lines += _table(
        ["workload", "arm", *(METRIC_LABELS[m] for m in metrics)],
        [
            [row["workload"], row["arm"], *(_spread(row["stats"][m]) for m in metrics)]
            for row in c["summary"]
        ],
    )
    breakdown = [row for row in c["summary"] if row["stats"].get("sched_step_us", {}).get("median")]
    if breakdown:
        lines += [
            "",
            "Per batch, µs (a process per service): the scheduler's step (apply results, "
            "schedule, submit), encoding and publishing the batch, delivering the client "
            "events; the worker decoding it; the NATS round trip (batch out, result back, "
            "minus the time the worker held it); the worker's idle time (host µs/batch) and "
            "its time executing (execute µs/batch; the in-process arms' is in the table above's "
            "ratios).",
            "",
        ]
        cols = [*BREAKDOWN_LABELS, "host_us_per_batch", "execute_us_per_batch"]
        lines += _table(
            ["workload", "arm", *(BREAKDOWN_LABELS.get(m, METRIC_LABELS.get(m, m)) for m in cols)],
            [
                [row["workload"], row["arm"], *(_spread(row["stats"][m]) for m in cols)]
                for row in breakdown
            ],
        )
    cpu = [row for row in c["summary"] if row["stats"].get("cpu_cores_busy", {}).get("median")]
    if cpu:
        cols = [m for m in CPU_METRICS if any(row["stats"].get(m, {}).get("median") for row in cpu)]
        lines += [
            "",
            "CPU, µs per batch by process, and cores busy (the CPU seconds of all of them per "
            "second of the run; the machine's CPUs are in the header):",
            "",
        ]
        lines += _table(
            ["workload", "arm", *(CPU_LABELS[m] for m in cols)],
            [
                [row["workload"], row["arm"], *(_spread(row["stats"][m]) for m in cols)]
                for row in cpu
            ],
        )
    lines += ["", "Ratios (each repeat's pair of runs ran back to back):", ""]
    lines += _table(
        ["ratio", "workload", "per repeat", "min", "median", "max", "target", "reached"],
        [
            [
                r["label"],
                r["workload"],
                ", ".join(fmt(v) for v in r["per_repeat"]),
                fmt(r["min"]),
                fmt(r["median"]),
                fmt(r["max"]),
                r["target"]["text"] if r["target"] else "",
                _reached(r["reached"]) if r["target"] else "",
            ]
            for r in c["ratios"]
        ],
    )
    if plot:
        lines += ["", f"![{c['name']}]({plot})"]
    lines.append("")
    return lines


def report_markdown(results: dict[str, Any], plots: dict[str, str]) -> str:
    m, machine, s = results["model"], results["machine"], results["settings"]
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    lines = [
        "# rlt bench report",
        "",
        f"- Date: {results['date']}",
        f"- Command: `{results['command']}`",
        f"- Machine: {machine['platform']}, {machine['cpu_count']} CPUs "
        f"({machine['torch_threads']} torch threads), torch {machine['torch']}, "
        f"device {machine['device']}{gpu}, git {machine.get('git_commit') or 'n/a'}",
        f"- Model: {m['size'] or m['checkpoint']} — hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, {m['num_attention_heads']} heads "
        f"({m['num_key_value_heads']} KV), vocab {m['vocab_size']}, "
        f"{m['total_ut_steps']} loops, {m['dtype']}",
        f"- Repeats: {s['repeats']} ({s['interleaving']}); seed {s['seed']}; "
        f"elapsed {results['elapsed_s']:.0f} s",
        "- Greedy decoding with ignore_eos, so every arm generates exactly the same tokens"
        + _token_exceptions(results),
        "",
        "## Targets",
        "",
        targets_markdown(results),
        "",
    ]
    for c in results["comparisons"]:
        lines += comparison_markdown(c, s["repeats"], plots.get(c["name"]))
    return "\n".join(lines)


def plot_comparison(c: dict[str, Any], path: Path) -> bool:
    """Grouped bars (median, min–max whiskers) per workload and arm; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    metrics = c["plot_metrics"]
    workloads = [w["name"] for w in c["workloads"]]
    arms = [a["name"] for a in c["arms"]]
    stats = {(r["workload"], r["arm"]): r["stats"] for r in c["summary"]}
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    colors = {arm: f"C{j}" for j, arm in enumerate(arms)}
    for ax, metric in zip(axes[0], metrics, strict=True):
        heights: list[float] = []
        for i, w in enumerate(workloads):
            # bars only for the arms that ran this workload, centred on its tick
            present = [
                (arm, st[metric])
                for arm in arms
                if (st := stats.get((w, arm))) and st.get(metric, {}).get("median") is not None
            ]
            width = 0.8 / max(1, len(present))
            for j, (arm, v) in enumerate(present):
                x = i + (j - (len(present) - 1) / 2) * width
                err = [[v["median"] - v["min"]], [v["max"] - v["median"]]]
                ax.bar(x, v["median"], width, yerr=err, capsize=3, color=colors[arm], label=arm)
                heights.append(v["median"])
        positive = [h for h in heights if h > 0]
        if positive and max(positive) / min(positive) > 20:
            ax.set_yscale("log")  # e.g. one request at a time next to batched arms
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(METRIC_LABELS.get(metric, metric), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes[0][0].legend(unique.values(), unique.keys(), fontsize=8)
    fig.suptitle(c["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _token_exceptions(results: dict[str, Any]) -> str:
    """The arms whose tokens may differ by design, for the report's header."""
    kinds = {c.get("kind") for c in results["comparisons"]}
    but = []
    if "overload" in kinds:
        but.append("overload's shed-depth arm where it sheds: fewer loops, other tokens")
    if "sparse_prefill" in kinds:
        but.append("sparse_prefill's sparse arm: frozen prompt tokens change its tokens")
    return f" (but {'; '.join(but)})." if but else "."


def write_report(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    plot_names: dict[str, str] = {}
    if plots:
        for c in results["comparisons"]:
            if c.get("error") or c.get("kind") in ("microbench", "disaggregation"):
                continue
            path = out_dir / f"{c['name']}.png"
            if c.get("kind") == "overload":
                from services.bench.comparisons.overload import plot as draw
            elif c.get("kind") == "sparse_prefill":
                from services.bench.comparisons.sparse_prefill import plot as draw
            else:
                draw = plot_comparison
            if draw(c, path):
                plot_names[c["name"]] = path.name
                written.append(path)
            else:
                print("rlt bench: matplotlib not installed; no plots", file=sys.stderr)
                break
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path = out_dir / "report.md"
    md_path.write_text(report_markdown(results, plot_names))
    return [json_path, md_path, *written]
