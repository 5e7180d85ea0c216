"""``rlt bench --only sparse_prefill`` runs every (device, workload, arm), judges its targets
and writes its report; the option-off arm's outputs equal the dense arm's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from services.cli import main

pytestmark = pytest.mark.slow


def test_quick_sparse_prefill_bench(toy_checkpoint: Path, tmp_path: Path) -> None:
    saved = structlog.get_config()  # main_bench quiets structlog: give it back
    try:
        argv = ["bench", "--quick", "--checkpoint", str(toy_checkpoint), "--only", "sparse_prefill"]
        assert main([*argv, "--repeats", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    finally:
        structlog.configure(**saved)
    results = json.loads((tmp_path / "results.json").read_text())
    (comp,) = results["comparisons"]
    seen = {(r["device"], r["workload"], r["arm"]) for r in comp["runs"]}
    assert len(seen) == 2 * 3 * 3 == len(comp["runs"])
    rows = {
        (r["device"], r["arm"]): r["metrics"]["prefill_rows_per_prompt_token"]
        for r in comp["runs"]
        if r["workload"] == "long"
    }
    for device in ("model", "sim"):
        assert rows[(device, "dense")] == rows[(device, "off")] == 4.0
        assert 2.35 <= rows[(device, "sparse")] < 2.45
    judged = [t for t in results["targets"] if t["comparison"] == "sparse_prefill"]
    assert len(judged) == 2 * (3 + 3)
    identical = [t for t in judged if t["metric"] == "identical"]
    assert all(t["reached"] for t in identical)
    report = (tmp_path / "report.md").read_text()
    assert "## Token-sparse prefill vs dense prefill" in report and "SIMULATED" in report
