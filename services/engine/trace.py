"""``rlt schedule-trace``: run offline and show every batch the scheduler built.

Plain output prints one line per batch, an indented line per request that the batch's
selection preempted (with the tokens it will recompute), and the waste totals at the end;
with ``--overload-policy shed-depth`` each line also shows the depth budget new decode
tokens started under in that step (``budget=N``); a token-sparse fragment shows its active
rows (``active[a..b)/n``: rows a to b of the n its window keeps at that depth);
``--json`` one JSON object per batch, ``preemptions`` included; ``--diagram`` adds, per
request, a wavefront grid (depth rows x chunk columns) whose cells name the step(s) that ran
that piece, so a maintainer sees the anti-diagonals at a glance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
from collections import defaultdict

from messages.batch import RowKind
from services.common.config import OverloadPolicy
from services.common.flags import sampling_params_from_args
from services.engine.engine import LLMEngine
from services.engine.offline import build_offline_engine
from services.scheduler.core.batch import ScheduledBatch, ScheduledTask


def request_names(n: int) -> list[str]:
    return [string.ascii_lowercase[i] if i < 26 else f"r{i}" for i in range(n)]


def row_text(task: ScheduledTask) -> str:
    """``(request, token_start, token_count, depth)``; a follow-on row's depth is not known
    when it is scheduled (the worker resolves it), so it shows as ``+``. A token-sparse
    fragment (its window, a sparse depth) adds its active rows: ``[first..end)/kept``."""
    depth = "+" if task.kind is RowKind.FOLLOW_ON else str(task.depth)
    text = f"({task.request.request_id},{task.token_start},{task.token_count},{depth}"
    if task.window_active:
        end = task.active_start + task.active_count
        text += f",active[{task.active_start}..{end})/{task.window_active}"
    return text + ")"


def batch_record(batch: ScheduledBatch) -> dict:
    return {
        "seq": batch.seq,
        "kind": str(batch.kind),
        "rows": [list(t.key()) for t in batch.tasks],
        "kinds": [str(t.kind) for t in batch.tasks],
        "loops": [t.num_loops for t in batch.tasks],
        "preemptions": [dataclasses.asdict(p) for p in batch.preemptions],
        "depth_budget": batch.depth_budget,
        # decode rows' lowered budgets (null: the request's own max_loops)
        "loop_budgets": [t.loop_budget for t in batch.tasks],
        # token-sparse fragments: [first active row, rows, the window's kept rows]; null
        # for every other row (its rows are its tokens)
        "active": [
            [t.active_start, t.active_count, t.window_active] if t.window_active else None
            for t in batch.tasks
        ],
        # hidden-state rows each task computes (token x loop; a fragment's active rows)
        "core_rows": [t.core_rows for t in batch.tasks],
    }


def prefill_origins(batch: ScheduledBatch) -> list[int]:
    """Each row's prefill origin (its prefix-cache hit) when the batch was built: chunks are
    counted from there, and a later preemption may move it."""
    return [t.request.prefill_window_origin for t in batch.tasks]


def waste_summary(engine: LLMEngine) -> str:
    """One line of what preemption and reservation cost over the run."""
    s = engine.scheduler.stats
    return (
        f"kv_admission={engine.config.kv_admission} preemptions={s.num_preemptions} "
        f"recomputed_prompt_tokens={s.num_recomputed_prompt_tokens} "
        f"recomputed_decode_loops={s.num_recomputed_decode_loops} "
        f"reserved_unused_blocks={s.num_reserved_unused_blocks}/{s.num_reserved_blocks} "
        f"prefill_rows={s.num_prefill_rows} prefill_rows_saved={s.num_prefill_rows_saved}"
    )


def wavefront_diagram(
    batches: list[tuple[ScheduledBatch, list[int]]],
    prompt_lens: dict[str, int],
    chunk: int,
    depths: int,
) -> str:
    """Cells: the step numbers that ran (chunk, depth) for each request's prompt. Chunks are
    numbered from the prefill origin, as the scheduler cuts them: c0 starts at the first
    position after a prefix-cache hit."""
    cells: dict[str, dict[tuple[int, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    origin_of: dict[str, int] = {}
    for batch, origins in batches:
        for task, origin in zip(batch.tasks, origins, strict=True):
            if task.kind is RowKind.DECODE or task.kind is RowKind.FOLLOW_ON:
                continue
            rid = task.request.request_id
            origin_of[rid] = origin
            first = (task.token_start - origin) // chunk
            last = (task.token_end - 1 - origin) // chunk
            levels = (
                [-1]
                if task.kind == RowKind.PRELUDE
                else list(range(task.depth, task.depth + task.num_loops))
            )
            if task.embed and task.kind == RowKind.PREFILL:
                levels = [-1, *levels]
            for c in range(first, last + 1):
                for level in levels:
                    steps = cells[rid][(c, level)]
                    if not steps or steps[-1] != batch.seq:
                        steps.append(batch.seq)
    lines: list[str] = []
    for rid, grid in cells.items():
        origin = origin_of[rid]
        n_chunks = -(-(prompt_lens[rid] - origin) // chunk)
        text = {k: "+".join(str(s) for s in v) for k, v in grid.items()}
        width = max([len(t) for t in text.values()] + [3])
        cached = f", {origin} cached (c0 starts at {origin})" if origin else ""
        lines.append(
            f"request {rid}: {prompt_lens[rid]} tokens{cached}, chunk {chunk}, cell = step(s)"
        )
        header = "        " + " ".join(f"c{c}".rjust(width) for c in range(n_chunks))
        lines.append(header)
        for level in range(-1, depths):
            label = "prelude" if level == -1 else f"depth {level}"
            row = " ".join(text.get((c, level), ".").rjust(width) for c in range(n_chunks))
            lines.append(f"{label:>7} {row}")
        lines.append("")
    return "\n".join(lines)


def run_schedule_trace(args: argparse.Namespace) -> int:

    traced: list[tuple[ScheduledBatch, list[int]]] = []
    engine, _, prompts = build_offline_engine(
        args, on_batch=lambda b: traced.append((b, prefill_origins(b)))
    )
    names = request_names(len(prompts))
    params = sampling_params_from_args(args)
    for name, prompt in zip(names, prompts, strict=True):
        engine.add_request(name, prompt, params)
    engine.run_until_done()
    shedding = engine.config.overload_policy is OverloadPolicy.SHED_DEPTH
    for batch, _ in traced:
        if args.json:
            print(json.dumps(batch_record(batch)))
        else:
            rows = " ".join(row_text(t) for t in batch.tasks)
            budget = f"budget={batch.depth_budget} " if shedding else ""
            print(f"seq={batch.seq:<4} {budget}{batch.kind!s:<19} {rows}")
            for preemption in batch.preemptions:
                print(f"{'':<28} {preemption.describe()}")
    if not args.json:
        print(waste_summary(engine))
        if shedding:
            print(f"shed_tokens={engine.scheduler.stats.num_shed_tokens}")
    if args.diagram:
        lens = {name: len(p) for name, p in zip(names, prompts, strict=True)}
        print()
        print(
            wavefront_diagram(
                traced, lens, engine.config.prefill_chunk_size, engine.model.cfg.total_ut_steps
            )
        )
    return 0
