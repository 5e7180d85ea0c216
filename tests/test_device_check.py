"""The one-command device check: ``--quick`` dry-runs every section on the CPU and writes its
report; its comparison and byte-count helpers; the device pipeline script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.py"
TABLE_HEADER = "| section | config | result | detail |"


def _script() -> ModuleType:
    """The entry script, loaded as a file the way it runs (it puts the repo root on sys.path
    for its sibling modules, ``scripts.device_check_*``)."""
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(report: str) -> list[list[str]]:
    lines = report[report.index(TABLE_HEADER) :].strip().splitlines()[2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.mark.services
def test_quick_dry_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report" / "dc.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=tmp_path,  # the script must find the repo on its own
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("report: ")
    report = out.read_text()
    for key in ("date", "hardware", "commit", "command"):
        assert f"- {key}: " in report, report[:600]
    assert "--quick" in report and "not GPU numbers" in report
    rows = _table(report)
    assert all(r[2] not in ("FAILED", "SKIPPED") for r in rows), rows
    by_section: dict[str, list[list[str]]] = {}
    for row in rows:
        by_section.setdefault(row[0], []).append(row)
    assert set(by_section) == {
        "env",
        "setup",
        "copy",
        "attention",
        "sampler",
        "flash_attn",
        "long_context",
        "pass_time",
        "decode",
        "hbm",
        "oracle",
        "bf16",
    }
    # the copy bandwidth, then decode attention alone: the Triton kernel (under the
    # interpreter here) within its tolerance of the reference, per case
    (copy,) = by_section["copy"]
    assert copy[2].endswith(" TB/s")
    attention = by_section["attention"]
    assert len(attention) == 2 and all(r[2].endswith(" us") for r in attention)
    assert all("max error" in r[3] and "splits" in r[3] for r in attention)
    # the sampler alone: the kernel (interpreted) draws the reference's tokens
    sampler = by_section["sampler"]
    assert len(sampler) == 2 and all(
        r[3].startswith("same tokens as the reference") for r in sampler
    )
    assert [r[2] for r in by_section["flash_attn"]] == ["not run"]  # needs CUDA
    # the long-context grid (2 x 2 here), then the two targets (GPU only)
    long = by_section["long_context"]
    assert len(long) == 6 and all(r[2].endswith(" ms/pass") for r in long[:4])
    assert {r[1] for r in long[:4]} == {
        f"{n} row{'s' if n > 1 else ''} x {c}, graphs->padded" for n in (1, 4) for c in (32, 128)
    }
    assert all("of the copy bandwidth" in r[3] for r in long[:4])
    assert [r[2] for r in long[4:]] == ["not a GPU", "not a GPU"]

    # 1: three row counts, graphs (padded on a CPU) and eager, every timed pass decode-only
    passes = by_section["pass_time"]
    assert len(passes) == 6 and all(r[2].endswith(" ms/pass") for r in passes)
    assert {r[1] for r in passes} >= {"1 row, graphs->padded", "8 rows, eager"}
    # 2: two concurrencies, early exit off and on
    decode = by_section["decode"]
    assert len(decode) == 4 and all(r[2].endswith(" tok/s") for r in decode)
    assert sum("exit on" in r[1] for r in decode) == 2
    # 3: the floor at the measured copy bandwidth, then one share per measured pass
    hbm = by_section["hbm"]
    assert hbm[0][2].endswith("ms/pass floor") and len(hbm) == 1 + len(passes)
    assert all("% of copy bandwidth" in r[2] for r in hbm[1:])
    # 4: the oracle, eager and static passes, both agreeing
    oracle = by_section["oracle"]
    assert [r[1] for r in oracle] == ["toy fp32, eager", "toy fp32, graphs->padded"]
    assert all(r[2].startswith("ok ") for r in oracle)
    # 5: bf16 against fp32
    (agree,) = by_section["bf16"]
    assert agree[2].startswith("top-1 ")

    data = json.loads(out.with_suffix(".json").read_text())
    assert data["command"].endswith(f"--quick --out {out}") and data["hardware"]
    assert len(data["rows"]) == len(rows) and not any(r["failed"] for r in data["rows"])
    oracle_rows = [r for r in data["rows"] if r["section"] == "oracle"]
    assert all(r["compared"] == r["total"] > 0 and not r["mismatches"] for r in oracle_rows)


@pytest.mark.unit
def test_a_failed_section_is_recorded_and_the_exit_code_says_so(tmp_path: Path) -> None:
    """hbm without pass timings has nothing to compare: its row fails, the report is still
    written; without the copy section it has no bandwidth to compare with."""
    out = tmp_path / "dc.md"
    assert _script().main(["--quick", "--only", "copy,hbm", "--out", str(out)]) == 1
    rows = _table(out.read_text())
    assert rows[0][0] == "env" and rows[-1][:3] == ["hbm", "measured passes", "FAILED"]
    assert "ms/pass floor" in rows[-2][2]
    assert _script().main(["--quick", "--only", "hbm", "--out", str(out)]) == 1
    assert _table(out.read_text())[-1][:3] == ["hbm", "copy bandwidth", "FAILED"]


@pytest.mark.unit
def test_hbm_bound_uses_the_cost_models_bytes() -> None:
    from scripts.device_check_accuracy import first_divergence
    from scripts.device_check_speed import pass_bytes
    from services.worker.model.toy import toy_config
    from services.worker.sim import SimCostModel

    cost = SimCostModel.for_model(toy_config("1.4b"))
    # Ouro-1.4B in bf16: 2.47 GB of core weights, 0.514 ms at 4.8 TB/s; KV 196,608 B/token
    assert pass_bytes(cost, 0) / cost.bytes_per_s * 1e3 == pytest.approx(0.514, abs=1e-3)
    assert pass_bytes(cost, 100) - pass_bytes(cost, 0) == 100 * 196_608
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.slow
def test_device_pipeline_script_cpu(tmp_path: Path) -> None:
    """The pipeline comparison as a GPU lease would run it, on the toy checkpoint here: both
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


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A minimal wheel of ``files`` (pip installs it with --no-deps --no-index)."""
    import zipfile

    dist = f"{name}-1.0.dist-info"
    meta = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    contents = {**files, **meta}
    contents[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*contents, f"{dist}/RECORD"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in contents.items():
            zf.writestr(member, text)
    return path


@pytest.mark.unit
def test_device_wheels_install_puts_the_cute_dsl_packages_on_the_path(tmp_path: Path) -> None:
    """What ``device_wheels.sh install`` prints is all the PYTHONPATH a lent machine gets: the
    CuTe DSL's ``cutlass`` package, which its wheels put under ``dsl_packages`` behind a .pth
    file (run only in a site directory), must import through it."""
    whl = tmp_path / "whl"
    _wheel(whl / "core", "fake_core", {"fake_core.py": ""})
    _wheel(whl / "flash", "fake_flash", {"fake_flash.py": ""})
    dsl = _wheel(
        tmp_path / "big",
        "fake_dsl",
        {
            "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "",
            "fake_dsl_packages.pth": "import sys; sys.path.insert(0, 'unused')\n",
        },
    )
    data = dsl.read_bytes()  # the big wheel travels in two halves
    for half, part, piece in (
        ("cutlass-1", "part-00", data[: len(data) // 2]),
        ("cutlass-2", "part-01", data[len(data) // 2 :]),
    ):
        (whl / half).mkdir()
        (whl / half / f"{dsl.name}.{part}").write_bytes(piece)
    env = dict(os.environ, WHL=str(whl), SITE=str(tmp_path / "site"), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_wheels.sh"), "install"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = proc.stdout.strip().splitlines()[-1]
    probe = subprocess.run(
        [sys.executable, "-c", "import cutlass, fake_core, fake_flash"],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, (path, probe.stderr[-2000:])
