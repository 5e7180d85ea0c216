"""The device check's accuracy sections (``scripts/device_check.py`` runs them):

4. ``oracle``: the engine in fp32 (toy and small checkpoints) against the serial oracle, eager
   and graphs, early exit included, stopping only at the oracle's own near-ties.
5. ``bf16``: greedy top-1 agreement of bf16 with fp32 on the 1.4B shape.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from scripts.device_check_common import (
    Child,
    free_device,
    make_engine,
    mode_label,
    random_prompts,
    run_requests,
)

if TYPE_CHECKING:  # the engine's imports stay lazy: the env row reports what is missing
    from services.engine.engine import LLMEngine
    from services.worker.model.ouro import OuroModel

# ---------------------------------------------------------------------------- 4. oracle


def section_oracle(c: Child) -> None:
    from messages.sampling import SamplingParams
    from services.oracle import SerialOracle
    from services.oracle.near_tie import compare_with_oracle
    from services.worker.model.ouro import OuroModel
    from services.worker.model.toy import write_toy_checkpoint
    from services.worker.passes.static_decode import DecodeMode

    plan = c.plan
    for size in plan.oracle_sizes:
        if c.out_of_time("oracle", f"{size} fp32"):
            continue
        try:
            ckpt = write_toy_checkpoint(c.tmp / f"oracle-{size}", seed=0, size=size)
            oracle = SerialOracle(ckpt)
            model = OuroModel.from_checkpoint(ckpt, dtype=torch.float32, device=c.device)
            cfg = model.cfg
            rng = random.Random(2)
            prompts = [
                [rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(3, 12))]
                for _ in range(plan.oracle_prompts)
            ]
            # fixed depth and three early-exit thresholds, mixed in one batch
            params = [
                SamplingParams(
                    max_tokens=plan.oracle_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    exit_threshold=threshold,
                    min_loops=1 if threshold < 1.0 else 2,
                ).resolve(cfg.total_ut_steps, cfg.vocab_size)
                for threshold in (1.0, 0.9, 0.7, 0.5) * plan.oracle_prompts
            ][: plan.oracle_prompts]
            t0 = time.perf_counter()
            expected = [
                oracle.generate(
                    prompt,
                    max_tokens=p.max_tokens,
                    min_loops=p.min_loops,
                    max_loops=p.max_loops,
                    exit_threshold=p.exit_threshold,
                    ignore_eos=True,
                )
                for prompt, p in zip(prompts, params, strict=True)
            ]
            print(f"  oracle {size}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:
            c.res.error("oracle", f"{size} fp32", exc)
            continue
        for mode in (DecodeMode.EAGER, DecodeMode.GRAPHS):
            label = f"{size} fp32, {mode}"
            if c.out_of_time("oracle", label):
                continue
            try:
                engine = make_engine(
                    model,
                    rows=len(prompts),
                    tokens_per_request=12 + plan.oracle_tokens + 1,
                    mode=mode,
                    prompt_len=12,
                )
                label = f"{size} fp32, {mode_label(engine, mode)}"
                finished = run_requests(engine, prompts, params, c.deadline, f"or-{mode}")
                static = engine.runner.static
                replays = static.replays if static is not None else 0
            except Exception as exc:
                c.res.error("oracle", label, exc)
                continue
            finally:
                engine = None
                free_device(c.device)
            comps = [compare_with_oracle(f, e) for f, e in zip(finished, expected, strict=True)]
            compared = sum(x.compared for x in comps)
            total = sum(x.total for x in comps)
            ties = [f"r{i} {x.near_tie}" for i, x in enumerate(comps) if x.near_tie]
            bad = [f"r{i} {x.mismatch}" for i, x in enumerate(comps) if x.mismatch]
            depths = [d for f in finished for d in f.exit_depths]
            # graphs mode that never went through a static pass would test nothing new
            unused = mode is DecodeMode.GRAPHS and replays == 0
            c.res.add(
                "oracle",
                label,
                ("MISMATCH" if bad else "ok") + f" {compared}/{total} tokens",
                f"{len(prompts)} requests, thresholds 1.0/0.9/0.7/0.5, mean exit depth "
                f"{sum(depths) / max(len(depths), 1):.2f}; {replays} static passes; "
                f"near-ties {len(ties)}: {'; '.join(ties) or 'none'}"
                + (f"; mismatches: {'; '.join(bad)}" if bad else "")
                + ("; NO static pass ran" if unused else ""),
                failed=bool(bad) or unused,
                compared=compared,
                total=total,
                near_ties=ties,
                mismatches=bad,
            )
        model = None
        free_device(c.device)


# ---------------------------------------------------------------------------- 5. bf16


def section_bf16(c: Child) -> None:
    from messages.sampling import SamplingParams
    from services.worker.passes.static_decode import DecodeMode

    plan = c.plan
    rng = random.Random(3)
    label = f"{plan.shape} bf16 vs fp32, fixed depth"
    fp32 = c.load(torch.float32)
    cfg = fp32.cfg
    prompts = random_prompts(rng, plan.agree_prompts, plan.prompt_len, cfg.vocab_size)
    greedy = SamplingParams(
        max_tokens=plan.agree_tokens, temperature=0.0, ignore_eos=True, exit_threshold=1.0
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    longest = plan.prompt_len + plan.agree_tokens + 1
    rows = min(128, plan.agree_prompts * plan.agree_tokens)

    def engine_for(model: OuroModel) -> LLMEngine:
        return make_engine(
            model,
            rows=rows,
            tokens_per_request=longest,
            mode=DecodeMode.GRAPHS,
            prompt_len=longest,
        )

    reference = run_requests(engine_for(fp32), prompts, greedy, c.deadline, "fp32")
    fp32 = None
    free_device(c.device)
    bf16 = c.load(torch.bfloat16)
    engine = engine_for(bf16)
    free = run_requests(engine, prompts, greedy, c.deadline, "bf16")
    # teacher-forced: every fp32 prefix as a prompt, one greedy bf16 token each
    forced = [
        p + ref.token_ids[:i]
        for p, ref in zip(prompts, reference, strict=True)
        for i in range(len(ref.token_ids))
    ]
    want = [t for ref in reference for t in ref.token_ids]
    got = [f.token_ids[0] for f in run_requests(engine, forced, one, c.deadline, "tf")]
    hits = sum(a == b for a, b in zip(got, want, strict=True))
    diverge = [
        first_divergence(f.token_ids, r.token_ids) for f, r in zip(free, reference, strict=True)
    ]
    same = sum(d is None for d in diverge)
    earliest = min((d for d in diverge if d is not None), default=None)
    c.res.add(
        "bf16",
        label,
        f"top-1 {100 * hits / len(want):.1f}%",
        f"teacher-forced: {hits}/{len(want)} greedy tokens equal over {len(prompts)} prompts "
        f"(every fp32 prefix, one bf16 token); free-running: {same}/{len(prompts)} sequences "
        f"equal"
        + (f", earliest divergence at token {earliest}" if earliest is not None else "")
        + "; random weights: information only",
        top1=hits / len(want),
        first_divergence=diverge,
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (in value or length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
