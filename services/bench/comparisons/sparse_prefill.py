"""``rlt bench --only sparse_prefill``: token-sparse prefill (``--token-sparse-prefill`` at
FlashLoop's default retention, 1,1,0.25,0.1) against dense prefill, side by side, on this
machine's model and on the simulated H200.

Per device, two workloads, the arms interleaved in every repeat (dense, sparse, off):

- ``long``: prompts of 1k tokens and more (up to 4k on the simulated H200; this machine's
  model is held to its ``max_position_embeddings``), one at a time (one client, closed
  loop): time to first token is the prompt's prefill alone;
- ``mixed``: chat requests (short prompts, longer answers) with long prompts among them, a
  third of the requests (RAG and agent traffic), a closed loop of several clients: the
  output tokens per second of the whole mix (the target);
- ``chat_heavy``: the same with one long prompt per six chat requests (reported: the gain
  shrinks with the prompts' share of the work).

Arms: ``dense`` (the engine's default), ``sparse`` (the server default on:
``token_sparse_prefill=True``, FlashLoop's retention, windows of ``WINDOW`` tokens) and
``off`` (a retention and window configured, the option off: its tokens and prompt rows must
be the dense arm's). Every request is greedy at fixed depth (``ignore_eos``), so only the
prefill differs between the arms. The simulated device charges a sparse fragment one read of
its window's context per query tile of the attention kernel (its active tokens are one
segment; see ``services.worker.sim``).

Times are read from ``open_loop.VirtualClock`` (this process's CPU seconds plus the simulated
device's), so other jobs on the shared cores do not move them. Prompt rows per prompt token
come from the finished events (``prefill_rows``), which are exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench.analysis import per_repeat_result
from services.bench.comparisons.open_loop import Outcome, VirtualClock, drive
from services.bench.metrics import percentile
from services.bench.progress import Progress
from services.bench.workloads import LengthMix, RequestSpec, TokenRange
from services.common.config import SchedulerConfig
from services.common.sparse_prefill import FLASHLOOP_RETENTION
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.sim import SimRunner

WINDOW = 1024
ARMS: dict[str, dict[str, Any]] = {
    "dense": {},
    "sparse": {"token_sparse_prefill": True, "prefill_retention": FLASHLOOP_RETENTION},
    "off": {"prefill_retention": FLASHLOOP_RETENTION, "sparse_window": 512},
}
# the simulated device's passes take this many times an H200's (as overload's): its device
# time, not this machine's scheduling CPU, is then what a run's clock mostly counts
SIM_DILATION = 10.0
LONG = 1024  # a prompt this long or longer is "long"


@dataclass(frozen=True)
class Mix:
    """A closed loop of ``clients`` over ``chat`` chat requests with ``long`` long prompts
    spread among them."""

    clients: int
    chat: int
    long: int


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    simulated: bool
    long_prompt: tuple[int, int]
    long_requests: int  # the long workload: one at a time
    mixed: Mix  # judged: a third of the requests long (RAG / agent traffic)
    chat_heavy: Mix  # reported: one long prompt per six chat requests


def devices(quick: bool, model_label: str, max_positions: int) -> list[Device]:
    top = min(4096, max_positions - 64)  # room for the answer
    if quick:
        return [
            Device("model", model_label, False, (LONG, min(1200, top)), 2, Mix(2, 4, 2),
                   Mix(2, 6, 1)),
            Device("sim", "simulated H200 (SIMULATED)", True, (LONG, 4096), 2, Mix(4, 8, 4),
                   Mix(4, 12, 2)),
        ]  # fmt: skip
    return [
        Device("model", model_label, False, (LONG, top), 6, Mix(8, 16, 8), Mix(8, 24, 4)),
        Device(
            "sim",
            f"simulated H200 (Ouro-1.4B passes x{SIM_DILATION:g}, SIMULATED)",
            True,
            (LONG, 4096),
            8,
            Mix(32, 64, 32),
            Mix(32, 96, 16),
        ),
    ]


CHAT = LengthMix(prompt=(16, 64), output=(32, 64))
WORKLOADS = ("long", "mixed", "chat_heavy")


def workloads(device: Device, vocab: TokenRange, seed: int) -> dict[str, list[RequestSpec]]:
    rng = random.Random(f"{seed}:sparse_prefill:{device.name}")

    def long_request(output: int) -> RequestSpec:
        n = rng.randint(*device.long_prompt)
        return RequestSpec(vocab.tokens(rng, n), output, kind="long")

    def mix(m: Mix) -> list[RequestSpec]:
        out = [dataclasses.replace(CHAT.draw(rng, vocab), kind="short") for _ in range(m.chat)]
        # the long prompts spread through the mix, so they land among decoding chat requests
        step = max(1, m.chat // max(1, m.long))
        for i in range(m.long):
            out.insert(min(len(out), (i + 1) * step + i), long_request(16))
        return out

    long = [long_request(8) for _ in range(device.long_requests)]
    return {"long": long, "mixed": mix(device.mixed), "chat_heavy": mix(device.chat_heavy)}


def clients_of(device: Device) -> dict[str, int]:
    return {"long": 1, "mixed": device.mixed.clients, "chat_heavy": device.chat_heavy.clients}


class _SimModel:
    """What ``LLMEngine`` reads of a model when a simulated device runs the passes: the
    configuration (the limits), here with Ouro-1.4B's 4096 positions."""

    def __init__(self, model: OuroModel, max_positions: int) -> None:
        self.cfg = dataclasses.replace(model.cfg, max_position_embeddings=max_positions)


class SparsePrefillBench:
    def __init__(self, model: OuroModel, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size

    def config(self, specs: list[RequestSpec], seats: int, arm: str) -> SchedulerConfig:
        longest = max(s.num_prompt_tokens + s.max_tokens for s in specs)
        planes = self.model.cfg.total_ut_steps
        blocks = seats * (-(-longest // self.block_size) + 1) * planes + 64
        return SchedulerConfig(
            max_num_seqs=seats,
            block_size=self.block_size,
            num_blocks=blocks,
            **({"sparse_window": WINDOW} | ARMS[arm]),
        )

    def run(
        self, device: Device, specs: list[RequestSpec], clients: int, arm: str
    ) -> tuple[list[Outcome], float]:
        config = self.config(specs, clients, arm)
        if device.simulated:
            sim = SimRunner.h200(self.model.cfg, dilation=SIM_DILATION)
            sim.sleep = False  # the clock adds the device time the cost model charged
            model: Any = _SimModel(self.model, 4096 + 64)
            engine = LLMEngine(model, config, simulated=sim)
            clock = VirtualClock(sim)
        else:
            engine = LLMEngine(self.model, config)
            clock = VirtualClock()
        return drive(engine, clock, specs, concurrency=clients)


def run_metrics(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    finished = [o.finished for o in outcomes if o.finished is not None]
    prompt = sum(f.num_prompt_tokens for f in finished)
    rows = sum(f.prefill_rows for f in finished)
    out_tokens = sum(len(f.token_ids) for f in finished)
    ttft_long = [
        o.token_times[0] - o.arrival
        for o in outcomes
        if o.token_times and o.finished is not None and o.finished.num_prompt_tokens >= LONG
    ]
    ttft = [o.token_times[0] - o.arrival for o in outcomes if o.token_times]
    digest = hashlib.blake2b(digest_size=8)  # every request's tokens and exit depths
    for o in outcomes:
        f = o.finished
        digest.update(repr(None if f is None else (f.token_ids, f.exit_depths)).encode())
    return {
        "wall_s": wall,
        "finished": len(finished),
        "prompt_tokens": prompt,
        "prefill_rows": rows,
        "prefill_rows_per_prompt_token": rows / prompt if prompt else None,
        "output_tokens_per_s": out_tokens / wall if wall else None,
        "ttft_ms_p50_long": _ms(percentile(ttft_long, 50)),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "digest": digest.hexdigest(),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def run_comparison(
    model: OuroModel,
    vocab: TokenRange,
    *,
    repeats: int,
    seed: int,
    quick: bool,
    model_label: str,
    progress: Progress,
) -> dict[str, Any]:
    bench = SparsePrefillBench(model)
    runs: list[dict[str, Any]] = []
    described: dict[str, Any] = {}
    for device in devices(quick, model_label, model.cfg.max_position_embeddings):
        specs = workloads(device, vocab, seed)
        clients = clients_of(device)
        bench.run(device, specs["long"][:1], 1, "sparse")  # untimed first use
        described[device.name] = {
            "label": device.label,
            "simulated": device.simulated,
            "workloads": {
                name: {
                    "requests": len(s),
                    "clients": clients[name],
                    "prompt_tokens": [
                        min(r.num_prompt_tokens for r in s),
                        max(r.num_prompt_tokens for r in s),
                    ],
                    "long_requests": sum(r.kind == "long" for r in s),
                }
                for name, s in specs.items()
            },
        }
        for repeat in range(repeats):
            for workload, requests in specs.items():
                for arm in ARMS:
                    progress.describe(
                        f"sparse_prefill r{repeat + 1}/{repeats} {device.name} {workload} {arm}"
                    )
                    outcomes, wall = bench.run(device, requests, clients[workload], arm)
                    runs.append(
                        {
                            "device": device.name,
                            "workload": workload,
                            "arm": arm,
                            "repeat": repeat,
                            "metrics": run_metrics(outcomes, wall),
                        }
                    )
                    progress.advance()
    return {
        "name": "sparse_prefill",
        "kind": "sparse_prefill",
        "title": "Token-sparse prefill vs dense prefill",
        "question": (
            "At FlashLoop's default retention (1, 1, 0.25, 0.1), windows of "
            f"{WINDOW} tokens: how many core rows does a prompt cost, how much sooner does a "
            "long prompt's first token come, and how much more does a mix of chat and long "
            "prompts generate per second? With the option off, is everything as it was?"
        ),
        "notes": notes(),
        "devices": described,
        "runs": runs,
        "ratios": ratios(runs, repeats, list(described)),
    }


def num_runs(repeats: int, quick: bool) -> int:
    return sum(repeats * len(WORKLOADS) * len(ARMS) for d in devices(quick, "", 4096))


def notes() -> list[str]:
    return [
        "Requests are greedy at fixed depth (ignore_eos), so the arms differ only in how the "
        "prompt is prefilled. Wavefront chunked prefill, async scheduling, chunk 512, "
        "budget 2048 (the engine's defaults) in every arm.",
        "Prompt rows per prompt token: the finished events' prefill_rows (hidden-state rows "
        "the prompt's loops computed) / prompt tokens. Dense is 4 (the loops); FlashLoop's "
        "schedule gives 1 + 1 + 0.25 + 0.1 = 2.35 plus the rounding up of each window's "
        "counts.",
        "TTFT (long): the long workload runs one prompt at a time, so its TTFT is the "
        "prompt's prefill alone. Times are virtual: this process's CPU seconds (torch on one "
        "thread), plus the simulated device's seconds on the sim device.",
        "The sim device runs no model: a pass costs what services/worker/sim.py's roofline "
        f"gives Ouro-1.4B on an H200, x{SIM_DILATION:g}. Its numbers are SIMULATED. It "
        "charges a sparse fragment its active rows and one read of its window's context per "
        "query tile of the GPU attention kernel (64 rows): a fragment's active tokens are one "
        "attention segment, each tile of them reads the context once. A dense chunk is "
        "charged one read of its context.",
        "off: a retention and another window configured with the option off; its tokens, "
        "exit depths and prompt rows must equal the dense arm's.",
    ]


def _per_repeat(
    runs: list[dict[str, Any]], device: str, workload: str, arm: str, metric: str, repeats: int
) -> list[Any]:
    out = []
    for r in range(repeats):
        found = [
            x["metrics"][metric]
            for x in runs
            if (x["device"], x["workload"], x["arm"], x["repeat"]) == (device, workload, arm, r)
        ]
        out.append(found[0] if found else None)
    return out


def _entry(
    label: str,
    where: str,
    metric: str,
    values: list[Any],
    target: tuple[str, float | None, float | None] | None,
) -> dict[str, Any]:
    return per_repeat_result(where, metric, label, "ratio", values, target)


def ratios(runs: list[dict[str, Any]], repeats: int, names: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for device in names:
        sim = " (SIMULATED)" if device == "sim" else ""

        def ratio(workload: str, metric: str, num: str, den: str, dev: str = device) -> list:
            a = _per_repeat(runs, dev, workload, num, metric, repeats)
            b = _per_repeat(runs, dev, workload, den, metric, repeats)
            return [x / y if x is not None and y else None for x, y in zip(a, b, strict=True)]

        out.append(
            _entry(
                "prompt rows per prompt token, sparse / dense",
                f"{device} long",
                "prefill_rows_per_prompt_token",
                ratio("long", "prefill_rows_per_prompt_token", "sparse", "dense"),
                (f"prefill core rows per prompt token <= 0.6x dense{sim}", None, 0.6),
            )
        )
        out.append(
            _entry(
                "TTFT p50 of prompts >= 1k tokens, sparse / dense",
                f"{device} long",
                "ttft_ms_p50_long",
                ratio("long", "ttft_ms_p50_long", "sparse", "dense"),
                (f"TTFT of prompts >= 1k <= 0.67x dense{sim}", None, 0.67),
            )
        )
        out.append(
            _entry(
                "output tokens/s of the mix, sparse / dense",
                f"{device} mixed",
                "output_tokens_per_s",
                ratio("mixed", "output_tokens_per_s", "sparse", "dense"),
                (f"mixed output tokens/s >= 1.3x dense{sim}", 1.3, None),
            )
        )
        out.append(
            _entry(
                "TTFT p50 of the long prompts in the mix, sparse / dense",
                f"{device} mixed",
                "ttft_ms_p50_long",
                ratio("mixed", "ttft_ms_p50_long", "sparse", "dense"),
                None,
            )
        )
        out.append(
            _entry(
                "output tokens/s of a chat-heavy mix, sparse / dense",
                f"{device} chat_heavy",
                "output_tokens_per_s",
                ratio("chat_heavy", "output_tokens_per_s", "sparse", "dense"),
                None,
            )
        )
        for workload in WORKLOADS:
            same = [
                None if a is None or b is None else float(a == b)
                for a, b in zip(
                    _per_repeat(runs, device, workload, "off", "digest", repeats),
                    _per_repeat(runs, device, workload, "dense", "digest", repeats),
                    strict=True,
                )
            ]
            out.append(
                _entry(
                    "option off: tokens and exit depths identical to dense (1 = yes)",
                    f"{device} {workload}",
                    "identical",
                    same,
                    ("with the option off, outputs unchanged", 1.0, None),
                )
            )
    return out


# ---------------------------------------------------------------------- report
def markdown(c: dict[str, Any]) -> list[str]:
    lines = [f"## {c['title']}", "", c["question"], "", *(f"- {n}" for n in c["notes"]), ""]
    lines += ["| device | workload | requests | clients | prompt tokens | long prompts |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for d in c["devices"].values():
        for name, w in d["workloads"].items():
            lo, hi = w["prompt_tokens"]
            lines.append(
                f"| {d['label']} | {name} | {w['requests']} | {w['clients']} | {lo}–{hi} | "
                f"{w['long_requests']} |"
            )
    cols = ("prefill_rows_per_prompt_token", "ttft_ms_p50_long", "ttft_ms_p50",
            "output_tokens_per_s", "wall_s")  # fmt: skip
    lines += ["", "Per run, median over the repeats:", ""]
    lines += [
        "| device | workload | arm | " + " | ".join(cols) + " |",
        "|" + "---|" * (3 + len(cols)),
    ]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in c["runs"]:
        groups.setdefault((r["device"], r["workload"], r["arm"]), []).append(r)
    for (device, workload, arm), rows in groups.items():
        cells = []
        for col in cols:
            values = [r["metrics"][col] for r in rows if r["metrics"][col] is not None]
            cells.append(f"{statistics.median(values):.4g}" if values else "n/a")
        lines.append(f"| {device} | {workload} | {arm} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio | where | per repeat | median | target | reached |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in c["ratios"]:
        per = ", ".join("n/a" if v is None else f"{v:.3g}" for v in r["per_repeat"])
        med = "n/a" if r["median"] is None else f"{r['median']:.3g}"
        target = r["target"]["text"] if r["target"] else ""
        reached = "" if r["target"] is None else ("**yes**" if r["reached"] else "**no**")
        lines.append(f"| {r['label']} | {r['workload']} | {per} | {med} | {target} | {reached} |")
    lines.append("")
    return lines


def plot(c: dict[str, Any], path: Path) -> bool:
    """The ratios against 1 (dense), one bar per ratio; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [r for r in c["ratios"] if r["metric"] != "identical" and r["median"] is not None]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(shown) + 1.5))
    labels = [f"{r['label']} [{r['workload']}]" for r in shown]
    values = [r["median"] for r in shown]
    lows = [r["median"] - r["min"] for r in shown]
    highs = [r["max"] - r["median"] for r in shown]
    ax.barh(labels, values, xerr=[lows, highs], color="C0", capsize=3)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("sparse / dense (median over repeats; bars: min-max)")
    ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(c["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
