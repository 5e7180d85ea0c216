"""``rlt eval CHECKPOINT``: the depth-quality report of a trained checkpoint."""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from services.oracle import SerialOracle
from services.train.model import LoopedLM

from .depth import fixed_depth_table
from .exit_sweep import best_saving, exit_sweep
from .held_out import held_out_stream, windows
from .kv_codec_cost import kv_codec_cost
from .report import write_results
from .sparse_cost import sparse_cost

THRESHOLDS = [0.99, 0.95, 0.9, 0.8, 0.7, 0.5]
SPARSE = [
    ((1.0, 1.0, 0.25, 0.1), 64),
    ((1.0, 1.0, 0.5, 0.25), 64),
    ((1.0, 1.0, 0.25, 0.1), 256),
    ((1.0, 1.0, 0.5, 0.25), 256),
]


def evaluate(checkpoint: Path, quick: bool) -> dict[str, Any]:
    stream = held_out_stream(checkpoint)
    model = LoopedLM.from_checkpoint(checkpoint)
    oracle = SerialOracle(checkpoint)
    n_depth, n_sweep, n_sparse = (2, 2, 2) if quick else (48, 24, 16)
    prompt, continuation = (16, 8) if quick else (64, 128)
    sparse_prompt, sparse_cont = (64, 4) if quick else (384, 32)

    depth_windows = windows(stream, n_depth, 513)
    with torch.no_grad():
        ids = depth_windows[0][:64]
        ours = model.logits(model.loops(ids[None]).hidden[-1])[0]
    oracle_diff = float((ours - oracle.prompt_logits(ids.tolist())).abs().max())
    depth = fixed_depth_table(model, depth_windows)
    sweep_windows = windows(stream, n_sweep, prompt + continuation)
    sweeps = [
        {"min_loops": m, "points": exit_sweep(oracle, sweep_windows, prompt, THRESHOLDS, m)}
        for m in (1, 2)
    ]
    sparse_settings = [(r, w if not quick else 32) for r, w in SPARSE]
    sparse = sparse_cost(
        oracle,
        windows(stream, n_sparse, sparse_prompt + sparse_cont),
        sparse_prompt,
        sparse_settings,
    )
    codec_prompt, codec_cont = (32, 8) if quick else (256, 64)
    loops = oracle.total_ut_steps
    anchors = [a for a in range(1, loops + 1) if loops % a == 0]  # Ouro's 4: 1, 2, 4
    codecs = kv_codec_cost(
        oracle, windows(stream, n_sparse, codec_prompt + codec_cont), codec_prompt, anchors
    )
    return {
        "checkpoint": str(checkpoint),
        "kv_codecs": codecs,
        "held_out": f"{stream.numel()} held-out tokens; {n_depth} windows of 512 for the "
        f"fixed-depth table, {n_sweep} of {prompt} prompt + {continuation} scored tokens for "
        f"the exit sweep, {n_sparse} of {sparse_prompt} + {sparse_cont} for sparse prefill, "
        f"{n_sparse} of {codec_prompt} + {codec_cont} for the KV codecs",
        "oracle_max_abs_diff": oracle_diff,
        "depth": depth,
        "exit_sweeps": sweeps,
        "sparse": sparse,
        "targets": _targets(depth, sweeps) + _codec_targets(codecs),
    }


def _targets(depth: list, sweeps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    first, last = depth[0], depth[-1]
    gain = first.loss - last.loss
    saving = best_saving(sweeps[0]["points"], 1.01)
    two = next(r for r in depth if r.loops == 2)
    return [
        {
            "target": f"held-out loss at {last.loops} loops >= 0.05 nats below 1 loop",
            "figure": f"{first.loss:.4f} - {last.loss:.4f} = {gain:.4f} nats",
            "met": gain >= 0.05,
        },
        {
            "target": "an exit threshold at <= 0.75x fixed depth's loops within 1% of its loss",
            "figure": "none within 1%"
            if saving is None
            else f"threshold {saving.threshold}: {saving.loops_ratio:.3f}x loops, "
            f"{saving.loss_ratio:.4f}x loss (min_loops 1)",
            "met": saving is not None and saving.loops_ratio <= 0.75,
        },
        {
            "target": f"greedy token after 2 loops == after {last.loops} on >= 70% of held-out",
            "figure": f"{two.agrees_with_final:.3f}",
            "met": two.agrees_with_final >= 0.7,
        },
    ]


def _codec_targets(rows: list) -> list[dict[str, Any]]:
    limits = {"fp8": (1.002, 0.97)}
    limits.update({r.codec: (1.01, 0.90) for r in rows if r.codec.startswith("int4-delta")})
    by = {r.codec: r for r in rows}
    out = []
    for codec, (max_loss, min_agree) in limits.items():
        r = by[codec]
        out.append(
            {
                "target": f"{codec}: held-out loss <= {max_loss:.3f}x auto, greedy == auto on "
                f">= {min_agree:.0%} of positions",
                "figure": f"{r.loss_ratio:.4f}x loss, {r.greedy_agreement:.3f} agreement",
                "met": r.loss_ratio <= max_loss and r.greedy_agreement >= min_agree,
            }
        )
    return out


def run_eval(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    results = evaluate(args.checkpoint, args.quick)
    results["command"] = "rlt eval " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 else "rlt eval"
    results["date"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    results["depth"] = [asdict(r) for r in results["depth"]]
    results["exit_sweeps"] = [
        {"min_loops": s["min_loops"], "points": [asdict(p) for p in s["points"]]}
        for s in results["exit_sweeps"]
    ]
    results["sparse"] = [asdict(r) for r in results["sparse"]]
    results["kv_codecs"] = [asdict(r) for r in results["kv_codecs"]]
    paths = write_results(results, args.out, plots=not args.no_plots)
    print((args.out / "report.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0
