"""``rlt eval``'s flags (no torch, so the CLI's parser can read them without loading it)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="a checkpoint `rlt train` wrote")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks/depth_quality"))
    p.add_argument("--quick", action="store_true", help="a few windows (seconds; for tests)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-plots", action="store_true")
