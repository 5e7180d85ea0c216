"""``rlt eval``'s results as JSON, a markdown table and one PNG."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any


def write_results(results: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=2, default=_plain) + "\n")
    paths[1].write_text(markdown(results))
    if plots:
        with contextlib.suppress(ImportError):  # matplotlib is a bench/dev extra
            paths.append(_plot(results, out / "depth_quality.png"))
    return paths


def _plain(value: Any) -> Any:
    return asdict(value)


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"Command: `{r['command']}`",
        "",
        f"Checkpoint: `{r['checkpoint']}`; {r['held_out']}",
        "",
    ]
    lines += ["### Fixed depth (teacher-forced, every position at d loops)", ""]
    lines += [
        "| loops | held-out loss (nats) | next-token accuracy | greedy == final loop's |",
        "|---|---|---|---|",
    ]
    for row in r["depth"]:
        lines.append(
            f"| {row['loops']} | {row['loss']:.4f} | {row['accuracy']:.3f} "
            f"| {row['agrees_with_final']:.3f} |"
        )
    lines += [
        "",
        f"Oracle check: the trainable model's final-depth logits equal the serial "
        f"oracle's within {r['oracle_max_abs_diff']:.1e}.",
        "",
    ]
    for sweep in r["exit_sweeps"]:
        lines += [
            f"### Exit threshold (min_loops {sweep['min_loops']}; oracle, teacher-forced "
            "decode with real exits)",
            "",
            "| exit_threshold | mean loops / token | loops vs fixed | held-out loss "
            "| loss vs fixed |",
            "|---|---|---|---|---|",
        ]
        for p in sweep["points"]:
            lines.append(
                f"| {p['threshold']} | {p['mean_loops']:.3f} | {p['loops_ratio']:.3f}x "
                f"| {p['loss']:.4f} | {p['loss_ratio']:.4f}x |"
            )
        lines.append("")
    lines += [
        "### Token-sparse prefill's cost (oracle; continuation scored at full depth)",
        "",
        "| retention | window | loops per prompt token | continuation loss | vs dense "
        "| first token == dense |",
        "|---|---|---|---|---|---|",
    ]
    for s in r["sparse"]:
        ret = "dense" if s["retention"] is None else ",".join(f"{x:g}" for x in s["retention"])
        lines.append(
            f"| {ret} | {s['window'] or '-'} | {s['rows_per_prompt_token']:.3f} "
            f"| {s['continuation_loss']:.4f} | {s['loss_ratio']:.4f}x "
            f"| {s['first_token_agreement']:.3f} |"
        )
    lines += [
        "",
        "### KV codecs' cost (oracle's codecs, teacher-forced continuation)",
        "",
        "| kv-cache-dtype | continuation loss | vs auto | greedy == auto |",
        "|---|---|---|---|",
    ]
    for c in r["kv_codecs"]:
        lines.append(
            f"| {c['codec']} | {c['loss']:.4f} | {c['loss_ratio']:.4f}x "
            f"| {c['greedy_agreement']:.3f} |"
        )
    lines += ["", "### Targets", "", "| target | figure | met |", "|---|---|---|"]
    for t in r["targets"]:
        lines.append(f"| {t['target']} | {t['figure']} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def _plot(r: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    depth = r["depth"]
    a.plot([d["loops"] for d in depth], [d["loss"] for d in depth], "o-", label="held-out loss")
    a.set_xlabel("loops (fixed depth)")
    a.set_ylabel("held-out loss (nats)")
    a2 = a.twinx()
    a2.plot(
        [d["loops"] for d in depth],
        [d["agrees_with_final"] for d in depth],
        "s--",
        color="tab:orange",
        label="greedy == final",
    )
    a2.set_ylabel("greedy token == final loop's")
    a.set_title("What each loop buys")
    for sweep in r["exit_sweeps"]:
        pts = sweep["points"]
        b.plot(
            [p["mean_loops"] for p in pts],
            [p["loss"] for p in pts],
            "o-",
            label=f"min_loops {sweep['min_loops']}",
        )
        for p in pts:
            b.annotate(f"{p['threshold']:g}", (p["mean_loops"], p["loss"]), fontsize=7)
    b.set_xlabel("mean loops per generated token")
    b.set_ylabel("held-out loss (nats)")
    b.set_title("Exit threshold: loops against loss")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
