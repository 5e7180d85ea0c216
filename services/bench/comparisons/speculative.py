"""``rlt bench --only speculative``: self-speculative decoding (``--speculative-tokens K
--draft-loops d``, docs/speculative.md) beside plain decoding, on this machine's model
in-process and on the simulated H100.

Sweep: K in {1, 2, 4, 8, auto} x d in {1, 2}, concurrency 1, 8 and 32, the exit gate off
(threshold 1) and on (threshold ``GATE_THRESHOLD``), every request greedy, ``ignore_eos``,
prompts cut from Python standard-library sources (what the trained checkpoint learned).

- In-process: the model's real drafts. Times are this process's CPU seconds (other jobs on
  the shared cores do not move them). Each arm's tokens are compared with the plain arm's
  (float32: they must be equal).
- Simulated H100 (``SimRunner.h100``: Ouro-1.4B's passes, bf16, a roofline of 3.35 TB/s
  and 989 TFLOP/s): tokens come from the simulator's hash, a draft agrees with its target
  with the acceptance the in-process run of the same (gate, d) measured, pooled over its K
  (``draft_acceptance``). With the gate on, tokens exit where the in-process plain runs'
  tokens exited (their measured share per exit depth, ``exit_distribution``), and since a
  position exiting by the draft depth is exact in the simulator too, its drafts agree at
  the rate the measured acceptance leaves for the others (``conditional_acceptance``).
  Times are the device seconds the cost model charged (the scheduler's CPU is not
  counted): decode tokens/s is what the device would give.

Per run: output tokens/s, core loop passes per generated token, mean inter-token latency
(per token: a burst of n tokens after a gap g counts n gaps of g / n), acceptance per draft
position, and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.bench.analysis import per_repeat_result
from services.bench.progress import Progress
from services.common.config import SchedulerConfig
from services.common.flags import AUTO_MAX_SPECULATIVE_TOKENS
from services.engine.engine import LLMEngine
from services.scheduler.core.spec_stats import SpecStats
from services.worker.model.ouro import OuroModel
from services.worker.sim import SimRunner

KS: tuple[int | str, ...] = (1, 2, 4, 8, "auto")
DRAFT_LOOPS = (1, 2)
CONCURRENCY = (1, 8, 32)
# requests per run, by concurrency (each MAX_TOKENS long)
REQUESTS = {1: 4, 8: 16, 32: 64}
GATE_THRESHOLD = 0.8  # exit gate on: min_loops 1 and this threshold
PROMPT_TOKENS = 32
MAX_TOKENS = 64
# targets of the issue (simulated H100, greedy): tokens/s vs plain at concurrency 1 and 8,
# auto's floor, and loop passes per token at concurrency 1
TARGET_C1, TARGET_C8, AUTO_FLOOR, PASSES_C1 = 1.5, 1.2, 0.97, 0.65


@dataclass(frozen=True)
class Arm:
    k: int | str  # 0: plain decoding
    d: int

    @property
    def name(self) -> str:
        return "plain" if self.k == 0 else f"K={self.k},d={self.d}"

    def config_fields(self) -> dict[str, Any]:
        if self.k == 0:
            return {}
        if self.k == "auto":
            return {
                "speculative_tokens": AUTO_MAX_SPECULATIVE_TOKENS,
                "speculative_auto": True,
                "draft_loops": self.d,
            }
        return {"speculative_tokens": self.k, "draft_loops": self.d}


def arms() -> list[Arm]:
    return [Arm(0, 1)] + [Arm(k, d) for d in DRAFT_LOOPS for k in KS]


def prompts(model: OuroModel, checkpoint: Path, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``PROMPT_TOKENS`` tokens cut from standard-library sources with the
    checkpoint's tokenizer (random ids where it has none)."""
    from services.common.tokenizer import TextCodec

    rng = random.Random(seed)
    codec = TextCodec.from_checkpoint(checkpoint)
    vocab = model.cfg.vocab_size
    if codec is None:
        return [[rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
    import sysconfig

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out: list[list[int]] = []
    while len(out) < n:
        text = rng.choice(sources).read_text(errors="ignore")
        if len(text) < 4000:
            continue
        at = rng.randrange(0, len(text) - 2000)
        ids = codec.encode(text[at : at + 2000])
        if len(ids) >= PROMPT_TOKENS:
            out.append(ids[:PROMPT_TOKENS])
    return out


@dataclass
class RunResult:
    tokens: dict[str, list[int]]
    seconds: float
    core_passes: int
    itl: float | None
    spec: SpecStats
    exits: list[int]  # each decode token's exit depth (the first token's is the prompt's)


def _drive(
    engine: LLMEngine,
    specs: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    clock: Callable[[], float],
) -> RunResult:
    """Closed loop: ``concurrency`` requests live at a time until all of ``specs`` ran."""
    start = clock()
    waiting = list(enumerate(specs))
    waiting.reverse()
    live = 0
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    exits: list[int] = []
    while waiting or engine.has_unfinished_requests():
        while waiting and live < concurrency:
            i, prompt = waiting.pop()
            engine.add_request(f"q{i}", prompt, params)
            live += 1
        events = engine.step()
        now = clock() - start
        for e in events:
            if isinstance(e, TokenEvent):
                times.setdefault(e.request_id, []).append(now)
            elif isinstance(e, FinishedEvent):
                tokens[e.request_id] = list(e.token_ids)
                exits += e.exit_depths[1:]
                live -= 1
    seconds = clock() - start
    gaps = []  # per request: its decode time over its decode tokens (tokens, not events)
    for ts in times.values():
        if len(ts) > 1:
            gaps.append((ts[-1] - ts[0]) / (len(ts) - 1))
    runner = engine.runner
    return RunResult(
        tokens,
        seconds,
        runner.stats.core_passes,
        statistics.mean(gaps) if gaps else None,
        engine.scheduler.spec_stats,
        exits,
    )


def pooled_acceptance(spec: SpecStats) -> float:
    """The chance that a draft is right given the ones before it were: accepted drafts over
    drafts reached (position i is reached by the cycles that accepted position i - 1)."""
    accepted = spec.accepted_per_position
    drafted = spec.drafted_per_position
    reached = [
        drafted[i] if i == 0 else min(accepted[i - 1], drafted[i]) for i in range(len(drafted))
    ]
    total = sum(reached)
    return sum(accepted) / total if total else 0.0


def exit_distribution(exits: list[int], total_loops: int) -> tuple[float, ...]:
    """The share of tokens exiting after 1, 2, ..., ``total_loops`` loops."""
    counts = [0] * total_loops
    for loops in exits:
        counts[loops - 1] += 1
    n = sum(counts) or 1
    return tuple(c / n for c in counts)


def conditional_acceptance(
    acceptance: float, distribution: tuple[float, ...] | None, draft_loops: int
) -> float:
    """A draft's chance to be right where its position did not exit by ``draft_loops``
    (those that did are exact): what the simulator's drafts agree at, so that its pooled
    acceptance is the measured one."""
    exact = sum(distribution[:draft_loops]) if distribution is not None else 0.0
    if exact >= 1.0:
        return 1.0
    return min(1.0, max(0.0, (acceptance - exact) / (1.0 - exact)))


class SpeculativeBench:
    def __init__(self, model: OuroModel, prompts: list[list[int]], block_size: int = 16) -> None:
        self.model = model
        self.prompts = prompts
        self.block_size = block_size

    def config(self, arm: Arm, concurrency: int) -> SchedulerConfig:
        longest = PROMPT_TOKENS + MAX_TOKENS
        planes = self.model.cfg.total_ut_steps
        blocks = concurrency * (-(-longest // self.block_size) + 1) * planes + 64
        return SchedulerConfig(
            max_num_seqs=concurrency,
            block_size=self.block_size,
            num_blocks=blocks,
            **arm.config_fields(),
        )

    def params(self, gate: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            min_loops=1,
            exit_threshold=GATE_THRESHOLD if gate else 1.0,
            ignore_eos=True,
        )

    def run(
        self,
        arm: Arm,
        concurrency: int,
        gate: bool,
        sim_acceptance: float | None,
        exits: tuple[float, ...] | None = None,
    ) -> RunResult:
        """In-process (``sim_acceptance`` None) or on the simulated H100, whose drafts agree
        at ``sim_acceptance`` and whose gated tokens exit by ``exits`` (a distribution)."""
        config = self.config(arm, concurrency)
        specs = self.prompts[: REQUESTS[concurrency]]
        if sim_acceptance is None:
            engine = LLMEngine(self.model, config)
            return _drive(engine, specs, self.params(gate), concurrency, time.process_time)
        sim = SimRunner.h100(self.model.cfg)
        sim.sleep = False  # the clock is the device time the cost model charged
        sim.draft_acceptance = sim_acceptance
        sim.exit_distribution = exits
        engine = LLMEngine(self.model, config, simulated=sim)
        return _drive(engine, specs, self.params(gate), concurrency, lambda: sim.simulated_s)


def _summary(
    result: RunResult, plain: RunResult, arm: Arm, where: str, concurrency: int, gate: bool
) -> dict[str, Any]:
    generated = sum(len(t) for t in result.tokens.values())
    return {
        "device": where,
        "arm": arm.name,
        "k": arm.k,
        "d": arm.d,
        "concurrency": concurrency,
        "gate": gate,
        "tokens": generated,
        "tokens_per_s": generated / result.seconds if result.seconds else None,
        "speedup": (generated / result.seconds) / (generated / plain.seconds)
        if result.seconds and plain.seconds
        else None,
        "passes_per_token": result.core_passes / generated if generated else None,
        "passes_ratio": (result.core_passes / generated)
        / (plain.core_passes / sum(len(t) for t in plain.tokens.values())),
        "itl_ms": None if result.itl is None else result.itl * 1e3,
        "acceptance_per_position": [round(a, 4) for a in result.spec.acceptance_per_position()],
        "acceptance": round(pooled_acceptance(result.spec), 4),
        "draft_tokens": result.spec.num_draft_tokens,
        "accepted_tokens": result.spec.num_accepted_tokens,
        "equal_to_plain": result.tokens == plain.tokens,
    }


def run_comparison(
    model: OuroModel,
    checkpoint: Path,
    *,
    seed: int = 0,
    quick: bool = False,
    model_label: str = "",
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every (device, gate, concurrency, arm) once; the simulated runs use the acceptance
    the in-process run of the same (gate, d) measured, and with the gate on the exit depths
    the in-process plain runs measured."""
    n_prompts = max(REQUESTS.values())
    bench = SpeculativeBench(model, prompts(model, checkpoint, n_prompts, seed))
    total_loops = model.cfg.total_ut_steps
    runs: list[dict[str, Any]] = []
    measured: dict[tuple[bool, int], list[float]] = {}
    exits: dict[bool, list[int]] = {False: [], True: []}
    distribution: dict[bool, tuple[float, ...] | None] = {False: None, True: None}
    for where in ("cpu", "sim"):
        # quick: the in-process sweep with K in {2, auto} (the acceptance the simulated
        # runs need); the simulated sweep is always whole
        quick_cpu = quick and where == "cpu"
        for gate in (False, True):
            if where == "sim" and gate:
                distribution[gate] = exit_distribution(exits[gate], total_loops)
            for c in CONCURRENCY:
                plain_arm = Arm(0, 1)
                acceptance = None
                if where == "sim":
                    acceptance = 0.0
                plain = bench.run(plain_arm, c, gate, acceptance, distribution[gate])
                if where == "cpu":
                    exits[gate] += plain.exits
                runs.append(_summary(plain, plain, plain_arm, where, c, gate))
                for arm in arms()[1:]:
                    if quick_cpu and arm.k not in (2, "auto"):
                        continue
                    if where == "sim":
                        found = measured.get((gate, arm.d), [])
                        pooled = statistics.mean(found) if found else 0.0
                        acceptance = conditional_acceptance(pooled, distribution[gate], arm.d)
                    result = bench.run(arm, c, gate, acceptance, distribution[gate])
                    summary = _summary(result, plain, arm, where, c, gate)
                    if where == "cpu" and result.spec.num_draft_tokens:
                        measured.setdefault((gate, arm.d), []).append(summary["acceptance"])
                    runs.append(summary)
                    if progress is not None:
                        progress.advance()
    return {
        "name": "speculative",
        "kind": "speculative",
        "title": "Self-speculative decoding",
        "question": "Do early loops drafting and deep loops verifying several tokens per pass "
        "raise decode tokens/s over plain decoding, with the same tokens?",
        "model": model_label,
        "notes": notes(),
        # with the gate on: the share of decode tokens exiting after 1..D loops, as the
        # in-process plain runs measured them (what the simulated gate draws from)
        "exit_distribution": [round(x, 4) for x in distribution[True] or ()],
        "runs": runs,
        "ratios": targets(runs),
    }


def notes() -> list[str]:
    return [
        "cpu: this machine's model in-process, CPU seconds of this process; every arm's "
        "tokens compared with plain decoding's (float32, greedy)",
        "sim: Ouro-1.4B on a simulated H100 SXM (3.35 TB/s, 989 TFLOP/s bf16 roofline), "
        "device seconds; drafts agree with the acceptance the cpu run of the same (gate, d) "
        "measured; tokens are the simulator's; gate on: tokens exit at the depths the cpu "
        "plain runs' tokens exited at (their measured distribution)",
        f"gate on: min_loops 1, exit threshold {GATE_THRESHOLD}; off: fixed depth",
    ]


def num_runs(quick: bool) -> int:
    """Speculating runs (what the progress counts): in-process, then simulated."""
    cpu_arms = 2 * len(DRAFT_LOOPS) if quick else len(arms()) - 1
    return 2 * len(CONCURRENCY) * (cpu_arms + len(arms()) - 1)


def _find(runs: list[dict[str, Any]], **where: Any) -> list[dict[str, Any]]:
    return [r for r in runs if all(r[k] == v for k, v in where.items())]


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets on the simulated H100 (gate off and on), each with its value, in
    the bench report's shape (``per_repeat_result``, one repeat)."""
    out: list[dict[str, Any]] = []
    for gate in (False, True):
        where = f"sim H100, gate {_on(gate)}"
        spec = [r for r in _find(runs, device="sim", gate=gate) if r["k"] != 0]
        for c, floor in ((1, TARGET_C1), (8, TARGET_C8)):
            best = max((r for r in spec if r["concurrency"] == c), key=lambda r: r["speedup"])
            out.append(
                per_repeat_result(
                    f"{where}, c={c}", "decode tokens/s", f"best ({best['arm']}) / plain",
                    "ratio", [best["speedup"]], (f">= {floor}x", floor, None),
                )
            )  # fmt: skip
        autos = [r for r in spec if r["k"] == "auto"]
        if autos:
            worst = min(autos, key=lambda r: r["speedup"])
            out.append(
                per_repeat_result(
                    where, "decode tokens/s", f"auto's worst (c={worst['concurrency']}, "
                    f"{worst['arm']}) / plain", "ratio", [worst["speedup"]],
                    (f">= {AUTO_FLOOR}x", AUTO_FLOOR, None),
                )
            )  # fmt: skip
        c1 = [r for r in spec if r["concurrency"] == 1]
        if c1:
            best = min(c1, key=lambda r: r["passes_ratio"])
            out.append(
                per_repeat_result(
                    f"{where}, c=1", "core loop passes per token", f"best ({best['arm']}) / "
                    "plain", "ratio", [best["passes_ratio"]], (f"<= {PASSES_C1}x", None, PASSES_C1),
                )
            )  # fmt: skip
    cpu = [r for r in runs if r["device"] == "cpu" and r["k"] != 0]
    equal = sum(r["equal_to_plain"] for r in cpu) / len(cpu) if cpu else None
    out.append(
        per_repeat_result(
            "cpu, every arm", "greedy tokens equal to plain (float32)", "share of arms",
            "share", [equal], ("== 1", 1.0, None),
        )
    )  # fmt: skip
    return out


def _on(gate: bool) -> str:
    return "on" if gate else "off"


def markdown(c: dict[str, Any]) -> list[str]:
    """The table: one row per (device, gate, concurrency, arm)."""
    lines = [
        f"### {c['title']}",
        "",
        *[f"- {n}" for n in c["notes"]],
        "",
        "| device | gate | c | arm | tok/s | vs plain | passes/token | vs plain | ITL ms "
        "| acceptance per position | = plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in c["runs"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:8])
        lines.append(
            f"| {r['device']} | {_on(r['gate'])} | {r['concurrency']} | {r['arm']} "
            f"| {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['passes_per_token']:.2f} "
            f"| {r['passes_ratio']:.2f} | {_ms(r['itl_ms'])} | {acc} | "
            f"{'yes' if r['equal_to_plain'] else 'NO'} |"
        )
    lines += ["", "| where | metric | of | value | target | reached |", "|---|---|---|---|---|---|"]
    for t in c["ratios"]:
        lines.append(
            f"| {t['workload']} | {t['metric']} | {t['label']} | {_num(t['median'])} "
            f"| {t['target']['text']} | {'yes' if t['reached'] else 'no'} |"
        )
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
