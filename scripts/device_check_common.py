"""What every section of the device check (``scripts/device_check.py``) shares: the sizes of
a run (``Plan``: ``FULL`` on the GPU, ``QUICK`` for the CPU dry run), the report's rows
(``Results``) and its markdown (``render``), the engine helpers the sections drive
(``make_engine``, ``run_requests``, ...) and a section's context in its child process
(``Child``).

The engine's packages are imported inside the functions, never here: the parent's env row
must be able to report what a bare machine lacks.
"""

from __future__ import annotations

import gc
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:  # the engine's imports stay lazy: the env row reports what is missing
    from messages.api import ErrorEvent, FinishedEvent
    from messages.sampling import SamplingParams
    from services.engine.engine import LLMEngine
    from services.worker.model.ouro import OuroModel
    from services.worker.passes.static_decode import DecodeMode

COLUMNS = ("section", "config", "result", "detail")
TABLE_HEADER = "| " + " | ".join(COLUMNS) + " |"


@dataclass(frozen=True)
class Plan:
    """Sizes of every section; --quick shrinks them all."""

    shape: str  # a CHECKPOINT_SIZES name, written in bf16 for sections 1, 2, 3 and 5
    rows: tuple[int, ...]
    warm_steps: int
    timed_steps: int
    concurrency: tuple[int, ...]
    prompt_len: int
    out_tokens: int
    oracle_sizes: tuple[str, ...]
    oracle_prompts: int
    oracle_tokens: int
    agree_prompts: int
    agree_tokens: int
    copy_mib: int  # the copy bandwidth's buffer
    attention_cases: tuple[tuple[int, int], ...]  # (rows, context) of the microbenchmark
    sampler_rows: tuple[int, ...]
    context_rows: tuple[int, ...]  # the long-context grid
    contexts: tuple[int, ...]
    kv_pool_gib: float  # most KV the long-context grid allocates (rows share blocks past it)
    repeats: int  # timed repeats of each kernel or pass (the median is reported)
    # hard time box of each child section, seconds: 435 s in all on the GPU, which leaves
    # the checkpoint write and start-up inside 8 minutes
    boxes: dict[str, float] = field(default_factory=dict)


FULL = Plan(
    shape="1.4b",
    rows=(1, 32, 128),
    warm_steps=12,
    timed_steps=96,
    concurrency=(1, 32, 128),
    prompt_len=16,
    out_tokens=64,
    oracle_sizes=("toy", "small"),
    oracle_prompts=8,
    oracle_tokens=24,
    agree_prompts=4,
    agree_tokens=24,
    copy_mib=2048,
    attention_cases=((1, 512), (1, 8192), (8, 2048), (32, 2048), (128, 2048)),
    sampler_rows=(1, 32, 128),
    context_rows=(1, 8, 32, 128),
    contexts=(512, 2048, 8192),
    kv_pool_gib=32.0,
    repeats=20,
    boxes={
        "copy": 15,
        "attention": 45,
        "sampler": 25,
        "flash_attn": 40,
        "long_context": 95,
        "pass_time": 60,
        "decode": 45,
        "oracle": 50,
        "bf16": 60,
    },
)
QUICK = Plan(
    shape="toy",
    rows=(1, 4, 8),
    warm_steps=3,
    timed_steps=8,
    concurrency=(1, 4),
    prompt_len=4,
    out_tokens=8,
    oracle_sizes=("toy",),
    oracle_prompts=4,
    oracle_tokens=6,
    agree_prompts=2,
    agree_tokens=4,
    copy_mib=64,
    attention_cases=((1, 200), (4, 64)),
    sampler_rows=(1, 4),
    context_rows=(1, 4),
    contexts=(32, 128),
    kv_pool_gib=0.05,
    repeats=3,
    boxes={
        "copy": 30,
        "attention": 60,
        "sampler": 60,
        "flash_attn": 30,
        "long_context": 60,
        "pass_time": 60,
        "decode": 60,
        "oracle": 60,
        "bf16": 60,
    },
)


# ---------------------------------------------------------------------------- results


class Results:
    """Rows of the report; ``on_change`` runs after every row (a child saves its rows, the
    parent rewrites the report), so a killed run keeps what it had."""

    def __init__(self, t0: float, on_change: Callable[[list[dict[str, Any]]], None]) -> None:
        self.t0 = t0
        self.on_change = on_change
        self.rows: list[dict[str, Any]] = []

    def add(
        self,
        section: str,
        config: str,
        result: str,
        detail: str = "",
        *,
        failed: bool = False,
        echo: bool = True,
        **extra: Any,
    ) -> None:
        row = {
            "section": section,
            "config": config,
            "result": result,
            "detail": detail,
            "failed": failed,
            **extra,
        }
        self.rows.append(row)
        if echo:
            print(f"[{time.time() - self.t0:6.1f}s] {section} | {config} | {result} | {detail}")
            sys.stdout.flush()
        self.on_change(self.rows)

    def error(self, section: str, config: str, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(exc))
        print(text, flush=True)  # the whole traceback in the log; the table gets its first line
        self.add(
            section,
            config,
            "FAILED",
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400],
            failed=True,
            traceback=text[-4000:],
        )


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# rlt device check", ""]
    for key in ("date", "hardware", "device", "commit", "command", "elapsed"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    if meta.get("note"):
        lines += ["", meta["note"]]
    lines += ["", TABLE_HEADER, "|---|---|---|---|"]
    for r in rows:
        cells = [str(r[k]).replace("|", "/").replace("\n", " ") for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- engine helpers


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call: CUDA events around each call
    on a GPU, the wall clock (with the call's own waits) on a CPU."""
    fn()
    sync_device(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def share_of_copy(bytes_per_s: float, copy_bytes_per_s: float | None) -> str:
    if not copy_bytes_per_s:
        return "no copy bandwidth measured"
    return f"{100 * bytes_per_s / copy_bytes_per_s:.1f}% of the copy bandwidth"


def free_device(device: torch.device) -> None:
    gc.collect()  # captured graphs and KV caches go with their engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_engine(
    model: OuroModel, *, rows: int, tokens_per_request: int, mode: DecodeMode, prompt_len: int
) -> LLMEngine:
    """An engine sized for ``rows`` requests of ``tokens_per_request`` tokens each, with
    room to spare so admission never holds a request back."""
    from services.common.config import SchedulerConfig
    from services.engine.engine import LLMEngine
    from services.worker.passes.static_decode import DecodeMode

    block_size = 16
    planes = model.cfg.total_ut_steps  # the default LAST_EXITED layout keeps one per depth
    per_request = -(-tokens_per_request // block_size) * planes
    config = SchedulerConfig(
        max_num_seqs=rows,
        max_num_batched_tokens=max(2048, rows * prompt_len),
        block_size=block_size,
        num_blocks=2 * per_request * rows + 16,
    )
    # graphs need CUDA; elsewhere the same static passes run eagerly (what a graph replays)
    if mode is DecodeMode.GRAPHS and model.device.type != "cuda":
        mode = DecodeMode.PADDED
    engine = LLMEngine(model, config, decode_mode=mode)
    _keep_tracebacks(engine)
    return engine


def _keep_tracebacks(engine: LLMEngine) -> None:
    """The executor turns a worker exception into an error event with one line; keep the
    traceback too, since on a lent GPU the log is all there is."""
    runner = engine.runner
    execute = runner.execute

    def traced(batch: Any) -> Any:  # a Batch in, a BatchResult out
        try:
            return execute(batch)
        except Exception:
            runner.last_traceback = traceback.format_exc()
            raise

    runner.last_traceback = None  # type: ignore[attr-defined]
    runner.execute = traced  # type: ignore[method-assign]


def raise_error_event(engine: LLMEngine, event: ErrorEvent) -> NoReturn:
    tb = getattr(engine.runner, "last_traceback", None)
    raise RuntimeError(
        f"request {event.request_id} failed ({event.code}): {event.message}"
        + (f"\nworker traceback:\n{tb}" if tb else "")
    )


def run_requests(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    deadline: float,
    tag: str,
) -> list[FinishedEvent]:
    """Runs the prompts to completion; their finished events in order. Raises on an error
    event (with the worker's traceback) or past the deadline."""
    from messages.api import ErrorEvent, FinishedEvent

    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, list(prompt), p)
    finished: dict[str, FinishedEvent] = {}
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            for rid in ids:
                engine.abort_request(rid)
            raise TimeoutError(f"section time box reached with {len(finished)}/{len(ids)} done")
        for event in engine.step():
            if isinstance(event, ErrorEvent):
                raise_error_event(engine, event)
            elif isinstance(event, FinishedEvent):
                finished[event.request_id] = event
    return [finished[rid] for rid in ids]


def mode_label(engine: LLMEngine, asked: DecodeMode) -> str:
    static = engine.runner.static
    actual = static.mode if static is not None else "eager"
    return str(asked) if actual == asked else f"{asked}->{actual}"


def random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------- section contexts


@dataclass
class Child:
    """What a section needs: sizes, device, the bf16 checkpoint, its rows, its deadline."""

    plan: Plan
    device: torch.device
    ckpt: Path | None
    res: Results
    deadline: float
    tmp: Path
    copy_bytes_per_s: float | None = None  # the ``copy`` section's, passed on by the parent

    def load(self, dtype: torch.dtype, max_positions: int | None = None) -> OuroModel:
        from services.worker.model.ouro import OuroModel

        if self.ckpt is None or not (self.ckpt / "config.json").exists():
            raise RuntimeError("no checkpoint: the setup row says why")
        t0 = time.perf_counter()
        model = OuroModel.from_checkpoint(
            self.ckpt, dtype=dtype, device=self.device, max_position_embeddings=max_positions
        )
        sync_device(self.device)
        print(
            f"  loaded {self.plan.shape} as {_dtype_name(dtype)} on {self.device} in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        return model

    def out_of_time(self, section: str, config: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.res.add(section, config, "SKIPPED", "section time box reached", failed=True)
        return True
