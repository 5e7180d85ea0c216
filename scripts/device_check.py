#!/usr/bin/env python3
"""One-command device check of the fused core pass on a lent GPU (H100 or H200), under 8
minutes.

    python3 scripts/device_check.py            # on the GPU machine: Ouro-1.4B shape, bf16
    python3 scripts/device_check.py --quick    # dry run on the CPU, toy checkpoint, seconds


Sections, each in its own child process with a time box (a hang, an OOM or a broken CUDA
context costs that section, never the report):

1. ``copy``: the copy bandwidth every share below is of, 2. ``attention``: decode attention
   alone on shuffled paged KV, 3. ``sampler``: the sampler alone, 4. ``flash_attn``:
   flash-attn 4 where it installs (``scripts/device_check_kernels.py``).
5. ``long_context``: whole decode passes at contexts of 512 to 8k, 1 to 128 rows
   (``scripts/device_check_context.py``).
6. ``pass_time``, 7. ``decode``, 8. ``hbm``: speed at short contexts
   (``scripts/device_check_speed.py``).
9. ``oracle``, 10. ``bf16``: accuracy (``scripts/device_check_accuracy.py``).

What they share (sizes, report rows, engine helpers) is in ``scripts/device_check_common.py``.
This file is the entry point: its arguments, the parent (env, hardware and commit lines,
the checkpoint, one child process per section, the report) and the child's main.

The report (markdown table + JSON) is rewritten after every row, so a run killed from
outside still leaves what it had.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the sibling modules import as ``scripts.device_check_*`` (a namespace package) from the root
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from anywhere: import the repo's packages
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.device_check_accuracy import section_bf16, section_oracle  # noqa: E402
from scripts.device_check_common import (  # noqa: E402
    FULL,
    QUICK,
    Child,
    Plan,
    Results,
    free_device,
    render,
)
from scripts.device_check_context import section_long_context  # noqa: E402
from scripts.device_check_kernels import (  # noqa: E402
    section_attention,
    section_copy,
    section_flash_attn,
    section_sampler,
)
from scripts.device_check_speed import hbm_rows, section_decode, section_pass_time  # noqa: E402

SECTIONS = (
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
)
# hbm is arithmetic on the pass_time rows, in the parent
CHILD_SECTIONS = tuple(s for s in SECTIONS if s != "hbm")
# sections that load the random checkpoint the parent writes
CHECKPOINT_SECTIONS = {"long_context", "pass_time", "decode", "bf16"}
CPU_NOTE = (
    "**CPU dry run: these are not GPU numbers.** Toy checkpoint and tiny counts on the CPU; "
    "graphs fall back to padded eager passes; the Triton kernels run under the interpreter; "
    "bandwidth shares are of the CPU's own copy bandwidth."
)


# ---------------------------------------------------------------------------- child process


SECTION_FNS: dict[str, Callable[[Child], None]] = {
    "copy": section_copy,
    "attention": section_attention,
    "sampler": section_sampler,
    "flash_attn": section_flash_attn,
    "long_context": section_long_context,
    "pass_time": section_pass_time,
    "decode": section_decode,
    "oracle": section_oracle,
    "bf16": section_bf16,
}


def child_main(args: argparse.Namespace, plan: Plan) -> int:
    result = Path(args.result)

    def save(rows: list[dict[str, Any]]) -> None:
        result.write_text(json.dumps(rows))

    res = Results(args.t0, save)
    box = plan.boxes[args.section]
    # leave time to write the last rows before the parent's hard kill
    deadline = time.monotonic() + box - min(15.0, box / 6)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else None
        c = Child(
            plan, torch.device(args.device), ckpt, res, deadline, Path(tmp), args.copy_bw or None
        )
        try:
            SECTION_FNS[args.section](c)
        except Exception as exc:  # the section's remaining rows are lost, the run is not
            res.error(args.section, "section", exc)
    return 0


def _child_env(device: str, section: str) -> dict[str, str]:
    env = dict(os.environ)
    if section != "flash_attn":
        # the other sections measure the Triton kernels, and need not compile flash-attn
        env["RLT_FLASH_ATTN"] = "0"
    if device == "cpu":  # toy-sized matmuls: more threads only contend (10x slower on 2 cores)
        env.setdefault("OMP_NUM_THREADS", "1")
        if section in ("attention", "sampler"):  # the Triton kernels on CPU tensors
            env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(
    section: str, args: argparse.Namespace, plan: Plan, ckpt: Path | None, res: Results
) -> None:
    """One section in a child process with a hard time box; its rows join ``res``."""
    box = plan.boxes[section]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_file = Path(fh.name)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        section,
        "--result",
        str(result_file),
        "--device",
        args.device,
        "--t0",
        repr(args.t0),
    ]
    if ckpt is not None:
        cmd += ["--ckpt", str(ckpt)]
    if args.quick:
        cmd.append("--quick")
    copy_bw = copy_bandwidth(res.rows)
    if copy_bw:
        cmd += ["--copy-bw", repr(copy_bw)]
    start = time.perf_counter()
    print(f"[{time.time() - args.t0:6.1f}s] == {section} (time box {box:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(args.device, section), timeout=box)
        status = None if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"killed at its {box:.0f} s time box"
    try:
        rows = json.loads(result_file.read_text() or "[]")
    except (OSError, json.JSONDecodeError):
        rows = []
    finally:
        result_file.unlink(missing_ok=True)
    for row in rows:
        res.add(**row, echo=False)  # the child printed them already
    took = time.perf_counter() - start
    if status is not None:
        res.add(section, "section", "FAILED", f"{status} after {took:.0f} s", failed=True)
    elif not rows:
        res.add(section, "section", "FAILED", "no rows came back", failed=True)
    print(f"[{time.time() - args.t0:6.1f}s] == {section} done in {took:.1f} s", flush=True)


def copy_bandwidth(rows: list[dict[str, Any]]) -> float | None:
    """Bytes per second the ``copy`` section measured, if it ran."""
    found = [r["bytes_per_s"] for r in rows if r["section"] == "copy" and r.get("bytes_per_s")]
    return found[-1] if found else None


# ---------------------------------------------------------------------------- parent


def _git(*argv: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def commit_line(given: str | None) -> str:
    sha = _git("rev-parse", "HEAD")
    if sha is None:  # a lent machine gets the working tree without .git
        return f"{given} (as given)" if given else "unknown (no git checkout)"
    dirty = _git("status", "--porcelain")
    return sha + (" + uncommitted changes" if dirty else "")


def hardware_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{torch.cuda.get_device_name(device)} ({props.total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({os.cpu_count()} cores), torch {torch.__version__}; no GPU"


def env_row(device: torch.device, res: Results) -> None:
    from kernels.ops import triton_available

    cuda = device.type == "cuda"
    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    missing = []
    for mod in ("msgspec", "structlog", "safetensors", "tokenizers", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    triton_ok = triton_available()
    if triton_ok:
        import triton

        parts.append(f"triton {triton.__version__}" + ("" if cuda else " (unused on the CPU)"))
    else:
        # the ops fall back to their torch references: the numbers would not be the kernels'
        parts.append("no usable triton" + (": the pass runs torch references" if cuda else ""))
    if missing:
        parts.append(f"MISSING {', '.join(missing)} (carry wheels: docs/gpu.md)")
    if cuda:
        from kernels.ops.attention_flash import flash_version, varlen_function

        flash = varlen_function() is not None
        parts.append(f"flash-attn {flash_version()}" if flash else "no flash-attn 4")
    bad_triton = cuda and not triton_ok
    result = "missing packages" if missing else "no triton" if bad_triton else "ok"
    res.add("env", str(device), result, "; ".join(parts), failed=bool(missing) or bad_triton)


def write_checkpoint(plan: Plan, device: torch.device, where: Path, res: Results) -> Path | None:
    """The random bf16 checkpoint the ``CHECKPOINT_SECTIONS`` load (drawn on the GPU when
    there is one: seconds rather than a minute of CPU randn)."""
    from services.worker.model.toy import write_toy_checkpoint

    t0 = time.perf_counter()
    try:
        ckpt = write_toy_checkpoint(
            where, seed=0, size=plan.shape, dtype=torch.bfloat16, gen_device=device
        )
    except Exception as exc:
        res.error("setup", f"{plan.shape} bf16 checkpoint", exc)
        return None
    free_device(device)
    nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    res.add(
        "setup",
        f"{plan.shape} bf16 random checkpoint",
        f"{nbytes / 1e9:.4g} GB",
        f"written in {time.perf_counter() - t0:.1f} s",
    )
    return ckpt


def default_out(quick: bool) -> Path:
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "docs" / "benchmarks"
    return base / ("device_check_quick.md" if quick else "device_check.md")


def parent_main(args: argparse.Namespace, plan: Plan, argv: list[str]) -> int:
    out = Path(args.out) if args.out else default_out(args.quick)
    if out.suffix != ".md":  # a folder
        out = out / ("device_check_quick.md" if args.quick else "device_check.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{device}{' (--quick)' if args.quick else ''}",
        "commit": commit_line(args.commit),
        "command": shlex.join(["python3", "scripts/device_check.py", *argv]),
        "note": CPU_NOTE
        if device.type == "cpu"
        else "**Quick run: toy checkpoint and tiny counts, not the 1.4B numbers.**"
        if args.quick
        else "",
    }

    def save(rows: list[dict[str, Any]]) -> None:
        meta["elapsed"] = f"{time.time() - args.t0:.0f} s"
        out.write_text(render(meta, rows))
        out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))

    res = Results(args.t0, save)
    if device.type == "cuda" and not torch.cuda.is_available():
        meta["hardware"] = hardware_line(torch.device("cpu"))
        res.add("env", str(device), "FAILED", "CUDA is not available here", failed=True)
    else:
        meta["hardware"] = hardware_line(device)
        if meta["note"]:
            print(meta["note"], flush=True)
        env_row(device, res)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if only & CHECKPOINT_SECTIONS:
                ckpt = write_checkpoint(plan, device, Path(tmp) / "ckpt", res)
            for section in SECTIONS:
                if section not in only:
                    continue
                if section == "hbm":
                    pass_rows = [r for r in res.rows if r["section"] == "pass_time"]
                    try:
                        hbm_rows(pass_rows, plan.shape, res, copy_bandwidth(res.rows))
                    except Exception as exc:
                        res.error("hbm", "section", exc)
                else:
                    run_child(section, args, plan, ckpt, res)
    save(res.rows)
    print("\n" + render(meta, res.rows), end="", flush=True)
    print(f"\nreport: {out} (+ {out.with_suffix('.json').name})", flush=True)
    return 1 if any(r.get("failed") for r in res.rows) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes on the CPU: a dry run")
    parser.add_argument("--device", help="cuda (default) or cpu (default with --quick)")
    parser.add_argument(
        "--out",
        help="report .md path or folder (JSON beside it); default $OUT, else docs/benchmarks/",
    )
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--commit", help="commit to record where the tree has no .git")
    parser.add_argument("--section", choices=CHILD_SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=time.time(), help=argparse.SUPPRESS)
    parser.add_argument("--copy-bw", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick else "cuda")
    if args.only and not set(args.only.split(",")) <= set(SECTIONS):
        parser.error(f"--only takes {','.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL
    if args.section:
        return child_main(args, plan)
    return parent_main(args, plan, argv)


if __name__ == "__main__":
    sys.exit(main())
