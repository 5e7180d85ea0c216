"""In-process engine tokens/s of this checkout against another commit, side by side.

Runs ``rlt bench --only depth_batching --arms refill`` (the in-process engine, continuous depth
batching, its two workloads: early exit and forced depth) on this tree and on ``--ref``
checked out in a temporary git worktree, alternating A B A B for ``--repeats`` rounds, and
prints each workload's output tokens/s per tree (median [min-max]) and the ratio of medians.

    .venv/bin/python scripts/bench_vs_ref.py --ref HEAD~5 --size toy --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(tree: Path, size: str, out: Path) -> dict[str, float]:
    """Output tokens/s of the refill arm per workload, from one bench run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "services.cli", "bench", "--size", size]
    cmd += ["--only", "depth_batching", "--arms", "refill", "--repeats", "1"]
    cmd += ["--no-plots", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    results = json.loads((out / "results.json").read_text())
    tokens: dict[str, float] = {}
    for comparison in results["comparisons"]:
        for run in comparison["runs"]:
            if run["arm"] == "refill":
                tokens[run["workload"]] = run["metrics"]["output_tokens_per_s"]
    return tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="the commit to compare against")
    p.add_argument(
        "--this",
        default=None,
        help="a commit to measure instead of this working tree (also in a temporary worktree)",
    )
    p.add_argument("--size", default="toy", choices=["toy", "small"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref_tree = Path(tmp) / "ref"
        this_tree = Path(tmp) / "this" if args.this else ROOT
        for tree, commit in ((ref_tree, args.ref), (this_tree, args.this)):
            if commit:
                subprocess.run(
                    ["git", "worktree", "add", "--detach", str(tree), commit],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                )
        try:
            trees = {"this": this_tree, args.ref: ref_tree}
            samples: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
            for i in range(args.repeats):
                for name, tree in trees.items():
                    got = run_bench(tree, args.size, Path(tmp) / f"{i}-{len(samples[name])}")
                    for workload, value in got.items():
                        samples[name].setdefault(workload, []).append(value)
                    print(f"round {i + 1}: {name}: {got}", file=sys.stderr)
        finally:
            for tree in {ref_tree, this_tree} - {ROOT}:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    this = args.this or "this tree"
    print(f"| workload ({args.size}) | {this} tok/s | {args.ref} tok/s | ratio of medians |")
    print("|---|---|---|---|")
    for workload in samples["this"]:
        row = []
        for name in trees:
            values = samples[name][workload]
            row.append(f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]")
        ratio = statistics.median(samples["this"][workload]) / statistics.median(
            samples[args.ref][workload]
        )
        print(f"| {workload} | {row[0]} | {row[1]} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
