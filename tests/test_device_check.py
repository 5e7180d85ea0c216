"""Smoke test of the one-command device check: ``--device cpu --quick`` prints its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADER = "| stage | config | result | detail |"


@pytest.mark.services
def test_device_check_quick_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--device", "cpu", "--quick"],
        cwd=tmp_path,  # the script must find the repo on its own
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert TABLE_HEADER in out
    table = out[out.rindex(TABLE_HEADER) :].strip().splitlines()
    assert out.rstrip().splitlines()[-1].startswith("|")  # the table is printed last
    stages = {line.split("|")[1].strip() for line in table[2:]}
    assert {"env", "kernels", "parity", "decode", "floor"} <= stages, table
    assert "FAILED" not in "\n".join(table)
    report = (tmp_path / "device_check.md").read_text()
    assert TABLE_HEADER in report
    rows = json.loads((tmp_path / "device_check.json").read_text())
    assert any(r["stage"] == "decode" and r["result"].endswith("tok/s") for r in rows)


@pytest.mark.slow
def test_device_pipeline_script_cpu(tmp_path: Path) -> None:
    """The issue-14 GPU run, as the lease would run it, on the toy checkpoint here: both
    benches finish inside their boxes and leave their reports where the lease fetches them."""
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        PYTHON=sys.executable,
        SIZE="toy",
        DEVICE="cpu",
        DTYPE="float32",
        EXTRA="--quick",
        REPEATS="1",
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_pipeline.sh")],
        cwd=tmp_path,  # the script must find the repo on its own
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("== exit 0") == 2, proc.stdout[-3000:]
    for folder, arms in (
        ("inline0", {"in_process", "pipeline", "in_process_async", "pipeline_async"}),
        ("inline50", {"in_process_async", "pipeline_async"}),
    ):
        results = json.loads((out / folder / "results.json").read_text())
        (comp,) = results["comparisons"]
        assert {r["arm"] for r in comp["runs"]} == arms
        assert "--arms" in results["command"] and results["targets"]
        assert (out / folder / "report.md").exists() and (out / f"{folder}.log").exists()
