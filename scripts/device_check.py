#!/usr/bin/env python3
"""One-command device check for a lent GPU (H200): kernels, parity, throughput, floor.

    python3 scripts/device_check.py                     # on the GPU machine, < 8 minutes
    python3 scripts/device_check.py --device cpu --quick  # smoke test anywhere, < 60 s

Stages (each time-boxed in its own child process, so a hang, an OOM or a broken CUDA context
costs one stage, never the report):

1. ``kernels``: ``pytest tests/test_gpu_kernels.py`` (SDPA / flash / KV ops vs CPU float32).
2. ``parity``: the in-process engine on a toy checkpoint in bf16 and fp32 against the CPU
   float32 serial oracle at fixed depth: free-running sequences and teacher-forced top-1.
3. ``throughput``: a random Ouro-1.4B-shaped bf16 checkpoint (written with safetensors in the
   HF format the loader reads), decode tokens/s at concurrency 1/32/128, early exit off/on.
4. A markdown table, printed last (and written to ``$OUT/device_check.md`` when ``$OUT`` is
   set), with the HBM-bandwidth floor of that shape for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from anywhere: import the repo's packages
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# H200 datasheet leads (H200.md): HBM3e bandwidth and dense bf16 matrix rate.
H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 990e12
TABLE_HEADER = "| stage | config | result | detail |"

from services.worker.model.sizes import CHECKPOINT_SIZES  # noqa: E402

# the 1.4B Ouro shape (head_dim = 2048 / 16 = 128), as `rlt toy-checkpoint --size 1.4b` writes it
OURO_1_4B = CHECKPOINT_SIZES["1.4b"]


@dataclass
class Plan:
    """Sizes of every stage; --quick shrinks them all."""

    kernels_timeout: float
    parity_timeout: float
    throughput_timeout: float
    parity_size: str
    parity_prompts: int
    parity_tokens: int
    shape: str  # a CHECKPOINT_SIZES name
    concurrency: tuple[int, ...]
    prompt_len: int
    out_tokens: int


FULL = Plan(120, 100, 220, "small", 8, 24, "1.4b", (1, 32, 128), 16, 64)
QUICK = Plan(45, 45, 45, "toy", 2, 4, "toy", (1, 4), 4, 8)


# ---------------------------------------------------------------------------- helpers


class Results:
    """Rows of the final table, saved after every row so a killed stage keeps what it had."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def add(
        self,
        stage: str,
        config: str,
        result: str,
        detail: str = "",
        *,
        echo: bool = True,
        **extra: Any,
    ) -> None:
        row = {"stage": stage, "config": config, "result": result, "detail": detail, **extra}
        self.rows.append(row)
        if echo:  # progress as it happens; the table comes at the end
            print(f"[{stage}] {config}: {result} {detail}", flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.rows))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(shape: dict[str, Any], bytes_per_param: int = 2) -> tuple[int, int]:
    """(bytes of core weights read per core pass, bytes of lm_head read per coda)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 4 * h  # qkv, o, gate/up/down, 4 norms
    core = shape["num_hidden_layers"] * per_layer + h + h + 1  # + final norm + exit gate
    return core * bytes_per_param, shape["vocab_size"] * h * bytes_per_param


def floor_tokens_per_s(shape: dict[str, Any], concurrency: int, depth: float) -> dict[str, float]:
    """Upper bounds on decode tokens/s for one H200.

    Per decode step every row runs ``depth`` loops: ``depth`` core passes over all weights
    plus one lm_head read, whatever the batch (weights dominate at short context; KV and
    activation traffic are ignored). Compute bound: 2 FLOP per weight per row per loop.
    """
    core_b, head_b = weight_bytes(shape)
    t_step_mem = (depth * core_b + head_b) / H200_HBM_BYTES_PER_S
    flops = 2 * concurrency * (depth * core_b / 2 + head_b / 2)
    t_step = max(t_step_mem, flops / H200_BF16_FLOPS)
    return {
        "pass_ms": core_b / H200_HBM_BYTES_PER_S * 1e3,
        "mem_tok_s": concurrency / t_step_mem,
        "roofline_tok_s": concurrency / t_step,
    }


def _make_engine(model: Any, config: Any, backend: str | None) -> Any:
    """LLMEngine whose runner uses ``backend``, allocating the KV cache only once."""
    import inspect

    import services.engine.engine as engine_mod

    if "attention_backend" in inspect.signature(engine_mod.LLMEngine).parameters:
        return engine_mod.LLMEngine(model, config, attention_backend=backend)
    original = engine_mod.ModelRunner

    def runner_factory(*args: Any, **kwargs: Any) -> Any:
        return original(*args, attention_backend=backend, **kwargs)

    # LLMEngine builds its runner by name; swap the name for the construction only.
    engine_mod.ModelRunner = runner_factory  # type: ignore[assignment,misc]
    try:
        return engine_mod.LLMEngine(model, config)
    finally:
        engine_mod.ModelRunner = original  # type: ignore[misc]


def _flash_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    from kernels import flash_unsupported_reason

    return flash_unsupported_reason(device, dtype, 256, head_dim) is None


def _backend_plan(
    device: torch.device, dtype: torch.dtype, head_dim: int, prefer: str
) -> tuple[str, int]:
    """(backend name, block size): flash needs block_size % 256 == 0; others use 16."""
    if prefer in ("auto", "flash") and _flash_ok(device, dtype, head_dim):
        return "flash", 256
    if prefer in ("auto", "flash"):
        return ("sdpa" if device.type == "cuda" else "reference"), 16
    return prefer, 16


# ---------------------------------------------------------------------------- stage: parity


def stage_parity(args: argparse.Namespace, plan: Plan, res: Results) -> None:
    from messages.api import FinishedEvent
    from messages.sampling import SamplingParams
    from services.common.config import SchedulerConfig
    from services.common.model_config import OuroConfig
    from services.oracle import SerialOracle
    from services.worker.model.ouro import OuroModel
    from services.worker.model.toy import write_toy_checkpoint

    device = torch.device(args.device)
    deadline = time.monotonic() + plan.parity_timeout - 10
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_toy_checkpoint(tmp, seed=0, size=plan.parity_size)
        oracle = SerialOracle(ckpt)
        rng = random.Random(0)
        prompts = [
            [rng.randrange(1, 400) for _ in range(rng.randint(4, 12))]
            for _ in range(plan.parity_prompts)
        ]
        expected = [
            oracle.generate(p, max_tokens=plan.parity_tokens, exit_threshold=1.0, ignore_eos=True)
            for p in prompts
        ]
        combos: list[tuple[torch.dtype, str]] = [(torch.bfloat16, "auto"), (torch.float32, "auto")]
        head_dim = OuroConfig.from_json_file(Path(ckpt) / "config.json").head_dim
        if _backend_plan(device, torch.bfloat16, head_dim, "auto")[0] == "flash":
            combos.append((torch.bfloat16, "sdpa"))  # compare both bf16 kernels
        if device.type == "cpu":
            combos.append((torch.float32, "sdpa"))
        for dtype, prefer in combos:
            name, block_size = _backend_plan(device, dtype, head_dim, prefer)
            label = f"{str(dtype).removeprefix('torch.')} {name} bs={block_size}"
            if time.monotonic() > deadline:
                res.add("parity", label, "skipped", "stage time box reached")
                continue
            try:
                model = OuroModel.from_checkpoint(ckpt, dtype=dtype, device=device)
                config = SchedulerConfig(block_size=block_size, num_blocks=1024)
                params = SamplingParams(
                    max_tokens=plan.parity_tokens, temperature=0.0, ignore_eos=True
                )
                free = _make_engine(model, config, name).generate(prompts, params)
                same_seq = sum(
                    f.token_ids == e.token_ids for f, e in zip(free, expected, strict=True)
                )
                # Teacher-forced: every oracle prefix as a prompt, one greedy token each.
                tf_prompts = [
                    p + e.token_ids[:i]
                    for p, e in zip(prompts, expected, strict=True)
                    for i in range(len(e.token_ids))
                ]
                tf_expect = [s for e in expected for s in e.steps]
                one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                tf: list[FinishedEvent] = _make_engine(model, config, name).generate(
                    tf_prompts, one
                )
                misses = [
                    s.top2_gap
                    for f, s in zip(tf, tf_expect, strict=True)
                    if f.token_ids[0] != s.token_id
                ]
                total = len(tf_expect)
                hits = total - len(misses)
                near_tie = sum(gap < 0.1 for gap in misses)
                # fp32 must agree except at exact ties; bf16 agreement is information only.
                exact = dtype == torch.float32
                bad = exact and any(gap >= 1e-4 for gap in misses)
                res.add(
                    "parity",
                    label,
                    f"top1 {100.0 * hits / total:.1f}%",
                    f"{'MISMATCH' if bad else 'ok' if exact else 'info'}; teacher-forced "
                    f"{hits}/{total} ({near_tie} of the misses at oracle top-2 gap < 0.1); "
                    f"free-running exact {same_seq}/{len(prompts)}",
                    top1=hits / total,
                    failed=bad,
                )
                del model
            except Exception as exc:  # report and go on with the next combination
                res.add(
                    "parity", label, "FAILED", f"{type(exc).__name__}: {exc}"[:300], failed=True
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- stage: throughput


@dataclass
class RunStats:
    requests: int
    tokens: int
    seconds: float
    decode_tokens: int
    decode_seconds: float
    mean_depth: float
    passes: int
    partial: bool


def timed_generation(
    engine: Any, prompts: list[list[int]], params: Any, device: torch.device, deadline: float
) -> RunStats:
    """Run to completion (or the deadline); decode time starts once every request has its
    first (prefill) token, so prompt processing is not counted as decode throughput."""
    from messages.api import TokenEvent

    passes0 = engine.runner.num_core_passes
    ids = [f"tp-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    _sync(device)
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    first_seen: set[str] = set()
    t_decode = None
    tokens = decode_tokens = 0
    depths: list[int] = []
    partial = False
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            partial = True
            for rid in ids:
                engine.abort_request(rid)
            break
        for event in engine.step():
            if isinstance(event, TokenEvent):
                tokens += 1
                if event.index == 0:
                    first_seen.add(event.request_id)
                    if len(first_seen) == len(ids):
                        t_decode = time.perf_counter()
                elif t_decode is not None:
                    decode_tokens += 1
                    depths.append(event.exit_depth)
    _sync(device)
    end = time.perf_counter()
    return RunStats(
        requests=len(ids),
        tokens=tokens,
        seconds=end - start,
        decode_tokens=decode_tokens,
        decode_seconds=(end - t_decode) if t_decode is not None else 0.0,
        mean_depth=sum(depths) / len(depths) if depths else float("nan"),
        passes=engine.runner.num_core_passes - passes0,
        partial=partial,
    )


def stage_throughput(args: argparse.Namespace, plan: Plan, res: Results) -> None:
    from messages.sampling import SamplingParams
    from services.common.config import SchedulerConfig
    from services.worker.model.ouro import OuroModel
    from services.worker.model.toy import toy_config, write_toy_checkpoint

    device = torch.device(args.device)
    deadline = time.monotonic() + plan.throughput_timeout - 15
    cfg = toy_config(plan.shape)
    dtype = torch.bfloat16
    name, block_size = _backend_plan(device, dtype, cfg.head_dim, args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        # drawn on the device when there is one (seconds, not a minute of CPU randn); sharded
        # so the multi-file loader path runs too
        ckpt = write_toy_checkpoint(
            Path(tmp) / "ckpt", size=plan.shape, dtype=dtype, gen_device=device, shard_bytes=1 << 30
        )
        nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        t1 = time.perf_counter()
        model = OuroModel.from_checkpoint(ckpt, dtype=dtype, device=device)
        _sync(device)
        res.add(
            "setup",
            f"{plan.shape} bf16 random checkpoint",
            f"{nbytes / 1e9:.2f} GB",
            f"written in {t1 - t0:.1f} s, loaded to {device} in {time.perf_counter() - t1:.1f} s",
        )
    d = cfg.total_ut_steps
    max_c = max(plan.concurrency)
    per_req = -(-(plan.prompt_len + plan.out_tokens) // block_size) * d
    config = SchedulerConfig(
        max_num_seqs=max_c,
        max_num_batched_tokens=max(2048, max_c * plan.prompt_len),
        block_size=block_size,
        num_blocks=per_req * max_c + 8,
    )
    engine = _make_engine(model, config, name)
    rng = random.Random(1)

    def prompts(n: int) -> list[list[int]]:
        return [
            [rng.randrange(1, cfg.vocab_size) for _ in range(plan.prompt_len)] for _ in range(n)
        ]

    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    warmed: set[int] = set()
    modes = (("off", 1.0, 2), ("on", 0.7, 1))
    for mode, threshold, min_loops in modes:
        for c in plan.concurrency:
            label = f"bf16 {name} bs={block_size} c={c} exit={mode}"
            if time.monotonic() > deadline:
                res.add("decode", label, "skipped", "stage time box reached")
                continue
            params = SamplingParams(
                max_tokens=plan.out_tokens,
                temperature=0.0,
                ignore_eos=True,
                exit_threshold=threshold,
                min_loops=min_loops,
            )
            try:
                if c not in warmed:  # per-shape kernel selection / JIT / allocator growth
                    timed_generation(engine, prompts(c), warm, device, deadline)
                    warmed.add(c)
                st = timed_generation(engine, prompts(c), params, device, deadline)
            except Exception as exc:
                res.add(
                    "decode", label, "FAILED", f"{type(exc).__name__}: {exc}"[:300], failed=True
                )
                continue
            tok_s = st.decode_tokens / st.decode_seconds if st.decode_seconds > 0 else 0.0
            detail = (
                f"{st.decode_tokens} decode tok in {st.decode_seconds:.2f} s "
                f"({st.tokens} tok, {st.seconds:.2f} s end to end); mean exit depth "
                f"{st.mean_depth:.2f}; {st.passes} core passes"
            )
            if plan.shape == "1.4b" and device.type == "cuda" and st.mean_depth == st.mean_depth:
                bound = floor_tokens_per_s(OURO_1_4B, c, st.mean_depth)["mem_tok_s"]
                detail += f"; {100 * tok_s / bound:.1f}% of HBM floor bound {bound:,.0f} tok/s"
            if st.partial:
                detail += "; PARTIAL (time box)"
            res.add("decode", label, f"{tok_s:,.1f} tok/s", detail, tok_s=tok_s)


# ---------------------------------------------------------------------------- stage: kernels


def stage_kernels(plan: Plan, res: Results) -> None:
    # -o addopts= drops the ini's extra -q so pytest still prints its "N passed" summary.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_gpu_kernels.py",
        "-q",
        "-rfE",
        "-o",
        "addopts=",
        "-p",
        "no:cacheprovider",
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=plan.kernels_timeout,
        )
    except subprocess.TimeoutExpired:
        res.add(
            "kernels",
            "pytest tests/test_gpu_kernels.py",
            "TIMEOUT",
            f"after {plan.kernels_timeout:.0f} s",
            failed=True,
        )
        return
    out = proc.stdout + proc.stderr
    print(out[-4000:], flush=True)
    counts = dict(
        (kind.rstrip("s"), int(n))
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", out)
    )
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or out.strip()[-200:]
    if proc.returncode == 0 and counts.get("passed", 0) == 0:
        result = "skipped"
    else:
        result = "ok" if proc.returncode == 0 else "FAILED"
    res.add(
        "kernels",
        "pytest tests/test_gpu_kernels.py",
        result,
        f"{summary} ({time.perf_counter() - start:.1f} s)",
        failed=proc.returncode != 0,
    )


# ---------------------------------------------------------------------------- orchestration


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_stage_child(stage: str, args: argparse.Namespace, timeout: float, res: Results) -> None:
    """Run one stage in a child process with a hard time box; merge its rows into ``res``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_file = Path(fh.name)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--stage",
        stage,
        "--result",
        str(result_file),
        "--device",
        args.device,
        "--backend",
        args.backend,
    ]
    if args.quick:
        cmd.append("--quick")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), timeout=timeout)
        status = None if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"TIMEOUT after {timeout:.0f} s"
    try:
        rows = json.loads(result_file.read_text() or "[]")
    except (OSError, json.JSONDecodeError):
        rows = []
    finally:
        result_file.unlink(missing_ok=True)
    for row in rows:
        res.add(**row, echo=False)  # the child already printed it
    if status is not None:
        res.add(
            stage, "stage", "FAILED", f"{status} ({time.perf_counter() - start:.0f} s)", failed=True
        )


def environment_row(args: argparse.Namespace, res: Results) -> None:
    from kernels import flash_attn_version

    parts = [f"torch {torch.__version__}", f"python {sys.version.split()[0]}"]
    if args.device.startswith("cuda") and torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    flash = flash_attn_version()
    parts.append(f"flash_attn {'.'.join(map(str, flash)) if flash else 'unavailable'}")
    missing = []
    for mod in ("msgspec", "structlog", "safetensors", "tokenizers"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        parts.append(f"MISSING {', '.join(missing)} (carry wheels: docs/gpu.md)")
    res.add("env", args.device, "missing packages" if missing else "ok", "; ".join(parts))


def floor_rows(plan: Plan, res: Results) -> None:
    core_b, head_b = weight_bytes(OURO_1_4B)
    d = OURO_1_4B["total_ut_steps"]
    base = floor_tokens_per_s(OURO_1_4B, 1, d)
    res.add(
        "floor",
        "1.4B bf16, H200 4.8 TB/s",
        f"{base['pass_ms']:.3f} ms/core pass",
        f"{core_b / 1e9:.2f} GB core weights per pass + {head_b / 1e9:.2f} GB lm_head per step; "
        f"depth {d}: {(d * core_b + head_b) / H200_HBM_BYTES_PER_S * 1e3:.2f} ms/decode step",
    )
    for c in FULL.concurrency:
        f = floor_tokens_per_s(OURO_1_4B, c, d)
        res.add(
            "floor",
            f"c={c} depth {d}",
            f"<= {f['mem_tok_s']:,.0f} tok/s",
            f"HBM bound; with the bf16 matrix rate ({H200_BF16_FLOPS / 1e12:.0f} TFLOP/s) too: "
            f"<= {f['roofline_tok_s']:,.0f} tok/s",
        )


def render(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", TABLE_HEADER, "|---|---|---|---|"]
    for r in rows:
        cells = [str(r[k]).replace("|", "/") for k in ("stage", "config", "result", "detail")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _stage_guard(res: Results, stage: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # a stage never takes the script down
        res.add(stage, "stage", "FAILED", f"{type(exc).__name__}: {exc}"[:300], failed=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke test")
    parser.add_argument("--backend", default="auto", choices=["auto", "flash", "sdpa", "reference"])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="report dir ($OUT)")
    parser.add_argument("--stage", choices=["parity", "throughput"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    if args.stage:  # child process: one stage, rows into --result
        res = Results(Path(args.result) if args.result else None)
        stage_fn: Callable[[argparse.Namespace, Plan, Results], None] = (
            stage_parity if args.stage == "parity" else stage_throughput
        )
        with _stage_guard(res, args.stage):
            stage_fn(args, plan, res)
        return 0

    start = time.perf_counter()
    res = Results(None)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        res.add("env", args.device, "FAILED", "CUDA is not available here", failed=True)
    else:
        with _stage_guard(res, "env"):
            environment_row(args, res)
        with _stage_guard(res, "kernels"):
            stage_kernels(plan, res)
        run_stage_child("parity", args, plan.parity_timeout, res)
        run_stage_child("throughput", args, plan.throughput_timeout, res)
    floor_rows(plan, res)
    elapsed = time.perf_counter() - start
    header = (
        f"## rlt device check: device={args.device}{' (quick)' if args.quick else ''}, "
        f"backend={args.backend}, {elapsed:.0f} s"
    )
    report = render(res.rows, header)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "device_check.md").write_text(report)
        (out / "device_check.json").write_text(json.dumps(res.rows, indent=1))
    print("\n" + report, end="", flush=True)
    return 1 if any(r.get("failed") for r in res.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
