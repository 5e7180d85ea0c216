"""The import layering (pyproject's [tool.importlinter] contracts) holds, and breaks loudly
when a cycle or a forbidden import comes back."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-logo", "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_tree(tmp_path: Path) -> Path:
    for name in ("services", "messages", "kernels", "tests"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_contracts_hold_on_the_tree() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # a cycle once removed: a lower module importing a helper back from the CLI
        (
            "services/engine/offline.py",
            "from services.cli import build_parser  # noqa: F401",
            "nothing imports the CLI",
        ),
        # any cycle between modules of one package
        (
            "services/scheduler/core/request.py",
            "from services.scheduler.core.scheduler import Scheduler  # noqa: F401",
            "no import cycles between packages",
        ),
        # one service reaching into another's internals
        (
            "services/admission/core.py",
            "from services.scheduler.core.request import Request  # noqa: F401",
            "no service imports another service's internals",
        ),
        (
            "tests/test_fit.py",
            "from tests.test_kernel_ops import torch  # noqa: F401",
            "no test module imports another",
        ),
        (
            "messages/api.py",
            "from services.common.config import KVLayout  # noqa: F401",
            "messages and kernels import no service",
        ),
    ],
)
def test_a_reintroduced_violation_fails(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    root = _copy_tree(tmp_path)
    with open(root / module, "a") as f:
        f.write(f"\n{line}\n")
    result = _lint(root)
    assert result.returncode != 0, result.stdout
    broken_part = result.stdout.split("Broken contracts", 1)[-1]
    assert broken in broken_part, result.stdout


_NO_TORCH = """
import sys
from services.cli import build_parser
from services.common.flags import scheduler_config_from_args
from services.launcher.build import admission_config, build_service

args = build_parser().parse_args(["service", "scheduler", "--checkpoint", sys.argv[1]])
config = scheduler_config_from_args(args)
admission = admission_config(args.router)
for name in ("scheduler", "admission", "prefix-cache", "gateway"):
    build_service(name, "nats://127.0.0.1:1", args.checkpoint, config, admission)
assert "torch" not in sys.modules, "torch imported"
build_service("worker", "nats://127.0.0.1:1", args.checkpoint, config)
assert "torch" in sys.modules  # the check can fail: the worker does import it
"""


def test_only_the_worker_imports_torch(toy_checkpoint: Path) -> None:
    """`rlt service scheduler` (admission, prefix-cache, gateway) runs no model: without
    torch each starts in a fraction of the time and memory (about 55 MB against 250 MB),
    which ``rlt up``'s five processes and compose's containers all pay."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(toy_checkpoint)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
