"""``rlt bench --only disaggregation``: chat streams decoding while long prompts arrive,
on two colocated shards against one prefill and one decode shard.

Every arm runs as OS processes on a real nats-server with SIMULATED workers (the cost
model of Ouro-1.4B on an H200, ``services/worker/sim.py``, times x ``DILATION`` so that two
CPU cores keep up with the control plane), and in the disaggregated arm the prompt KV moves
between the two worker processes for real, with NIXL: each simulated worker holds host KV
arenas of Ouro-1.4B's shape with ``RLT_SIM_KV_LAYERS`` of its 24 layers, so a pull moves
1/24 of what a real Ouro-1.4B prompt needs (the report states both, and the real prompt's
time at the GB/s measured). Measured per arm: the chat streams' inter-token latency
(p50, p99, client side), output tokens/s, and in the disaggregated arm each pull's time
(handed to the transfer thread -> done, the decode worker's own timing) for the long
prompts and for the chat prompts apart, the link's GB/s (bytes over the pulls' own copy
time) and the handover gap (a chat stream's token 0 -> 1). Every time that contains
simulated compute is labelled SIM; the transfer times are real (this machine's CPU and
memory), and the real-prompt time is an estimate from them.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import nats

from messages.api import GenerateRequest
from services.bench.processes import ServiceProcesses
from services.common.config import SchedulerConfig
from services.launcher import NatsServer, free_port
from services.runtime import subjects
from services.runtime.bus import encode_json

DILATION = 40.0
SIM_KV_LAYERS = 1
OURO_LAYERS = 24
CHAT_STREAMS = 8
CHAT_PROMPT, CHAT_TOKENS = 48, 256
LONG_PROMPTS = (1024, 2048, 3072, 4000)  # cycled
LONG_EVERY_S = 1.5
LONG_TOKENS = 4
ARMS = {"colocated": ("both", "both"), "disaggregated": ("prefill", "decode")}
TARGETS = {
    "chat_itl_p99": ("chat ITL p99 <= 0.5x colocated (SIM compute)", None, 0.5),
    "output_tokens_per_s": ("output tokens/s >= 0.9x colocated (SIM compute)", 0.9, None),
}
# bytes a simulated worker pulls per 16-token block of a prompt: every loop's plane (4), K
# and V, SIM_KV_LAYERS layers of 16 KV heads x 128 x bf16 x 16 tokens
BLOCK_PULL_BYTES = 4 * 2 * SIM_KV_LAYERS * 16 * 128 * 2 * 16
# pulls above this are the long prompts' (a chat prompt's is 1.5 MB, the shortest long
# prompt's 32 MB)
LONG_PULL_BYTES = 2 * -(-CHAT_PROMPT // 16) * BLOCK_PULL_BYTES


def bench_checkpoint(workdir: Path) -> Path:
    """The toy checkpoint with room for 4k-token prompts (the simulated workers read only
    its config; admission and schedulers its limits and tokenizer)."""
    from services.worker.model.toy import write_toy_checkpoint

    path = write_toy_checkpoint(workdir / "ckpt", seed=0, size="toy")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    return path


def engine_config() -> SchedulerConfig:
    return SchedulerConfig(
        block_size=16, num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048,
        prefill_chunk_size=512,
    )  # fmt: skip


def run_comparison(repeats: int, seed: int = 0, quick: bool = False) -> dict[str, Any]:
    import tempfile

    runs: list[dict[str, Any]] = []
    duration = 12.0 if quick else 30.0
    with tempfile.TemporaryDirectory(prefix="rlt-bench-pd-") as tmp:
        checkpoint = bench_checkpoint(Path(tmp))
        for repeat in range(repeats):
            for arm, roles in ARMS.items():  # alternated: the machine's load hits both
                metrics = _run_arm(checkpoint, roles, duration, seed + repeat)
                runs.append({"repeat": repeat, "arm": arm, **metrics})
    ratios = []
    for metric, (text, low, high) in TARGETS.items():
        per_repeat = []
        for repeat in range(repeats):
            by_arm = {r["arm"]: r[metric] for r in runs if r["repeat"] == repeat}
            per_repeat.append(by_arm["disaggregated"] / by_arm["colocated"])
        median = statistics.median(per_repeat)
        reached = (low is None or median >= low) and (high is None or median <= high)
        ratios.append(
            {
                "workload": "chat + long prompts", "metric": metric,
                "numerator": "disaggregated", "denominator": "colocated", "kind": "ratio",
                "label": text, "per_repeat": per_repeat, "min": min(per_repeat),
                "median": median, "max": max(per_repeat),
                "target": {"text": text, "low": low, "high": high}, "reached": reached,
            }
        )  # fmt: skip
    return {
        "name": "disaggregation",
        "kind": "disaggregation",
        "title": "Prefill/decode disaggregation (SIMULATED H200 compute, real NIXL transfers)",
        "question": (
            "Do chat streams keep their inter-token latency while long prompts (1-4k "
            "tokens) arrive, when prompts run on a prefill shard and decoding on a decode "
            "shard that pulls each prompt's KV with NIXL, against two colocated shards?"
        ),
        "notes": _notes(duration),
        "runs": runs,
        "ratios": ratios,
    }


def _notes(duration: float) -> list[str]:
    per_token_real = (
        OURO_LAYERS * 2 * 16 * 128 * 2 * 4
    )  # layers x K,V x heads x dim x bf16 x planes
    token_s = sim_chat_token_s()
    return [
        f"SIMULATED device: Ouro-1.4B on an H200 (cost model), every time x{DILATION:g}; "
        "two shards per arm (colocated: both roles on each, router prefix; disaggregated: "
        "shard 0 prefill, shard 1 decode), all services OS processes on one nats-server.",
        f"{CHAT_STREAMS} closed-loop chat streams ({CHAT_PROMPT}-token prompts, "
        f"{CHAT_TOKENS} tokens each) for {duration:g} s while a long prompt "
        f"({'/'.join(map(str, LONG_PROMPTS))} tokens, {LONG_TOKENS} output tokens) arrives "
        f"every {LONG_EVERY_S:g} s; greedy, full depth (4 loops).",
        f"KV moved for real: each simulated worker holds Ouro-1.4B-shaped host KV with "
        f"{SIM_KV_LAYERS} of its {OURO_LAYERS} layers, so a pull moves "
        f"{SIM_KV_LAYERS}/{OURO_LAYERS} of a real prompt's bytes; a real Ouro-1.4B prompt "
        f"needs {per_token_real:,} bytes per token (every loop's KV: 4 planes), "
        f"{per_token_real * 4000 / 1e9:.2f} GB for 4,000 tokens. 'real prompt s' is that at "
        "the GB/s measured here (host memory, UCX on one machine).",
        "ITL: gaps between a chat stream's consecutive tokens at the client; the handover "
        "gap (token 0 -> 1 of a chat stream: the handoff, pull and release) is among them "
        "and also reported alone. Both contain SIMULATED compute (x40), as do tokens/s and "
        "TTFT: only their ratios between the arms are meant to carry over.",
        f"Why x{DILATION:g}: the cost model charges a chat token on the decode shard (all "
        f"{CHAT_STREAMS} streams in one pass, mid-stream contexts, 4 loops and the coda) "
        f"{token_s * 1e3:.1f} ms undilated, {token_s * DILATION * 1e3:.0f} ms dilated: the "
        "decode shard's SIM chat ITL p50 above that is the control plane's share, which "
        "must stay small. Transfers are real time and move "
        f"{SIM_KV_LAYERS}/{OURO_LAYERS} of the bytes, so relative to the compute a pull "
        f"weighs 1/{OURO_LAYERS // SIM_KV_LAYERS * DILATION:.0f} of a real prompt's at the "
        "same rate: the targets show where prompts run, not whether a link keeps up.",
        "Pulls (REAL: NIXL over UCX between two processes on this CPU): time from the pull's "
        "hand-over to the decode worker's transfer thread to its last byte (queueing behind "
        "other pulls included), for the long prompts' pulls and the chat prompts' apart; "
        "GB/s is bytes over the pulls' own chunk copy time. 'est. real prompt s' is an "
        "estimate (a real prompt's bytes at that rate), not a measurement.",
    ]


def sim_chat_token_s() -> float:
    """The cost model's undilated time for one chat token on the decode shard: every
    chat stream's row in each of the 4 loops' passes at mid-stream contexts, and the coda."""
    from services.worker.model.toy import toy_config
    from services.worker.sim import SimCostModel

    cost = SimCostModel.for_model(toy_config("1.4b"))
    context = CHAT_STREAMS * (CHAT_PROMPT + CHAT_TOKENS // 2)
    return 4 * cost.core_pass_s(CHAT_STREAMS, context, context) + cost.coda_s(CHAT_STREAMS)


def _run_arm(
    checkpoint: Path, roles: tuple[str, str], duration: float, seed: int
) -> dict[str, Any]:
    env = {"RLT_SIM_DILATION": repr(DILATION), "RLT_SIM_KV_LAYERS": str(SIM_KV_LAYERS)}
    server = NatsServer(host="127.0.0.1", port=free_port()).start()
    try:
        with ServiceProcesses(
            server.url, checkpoint, engine_config(), shards=2, router="prefix",
            worker_device="sim", env=env, roles=roles,
        ) as _procs:  # fmt: skip
            return asyncio.run(_drive(server.url, duration, seed, disaggregated=roles[0] != "both"))
    finally:
        server.stop()


async def _drive(url: str, duration: float, seed: int, disaggregated: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    nc = await nats.connect(url, connect_timeout=5)
    tag = uuid.uuid4().hex[:6]
    gaps: list[float] = []
    handover_gaps: list[float] = []
    tokens = 0
    long_ttft: list[float] = []
    stop_at = time.perf_counter() + duration
    count = 0

    async def one(prompt_len: int, max_tokens: int, chat: bool) -> None:
        nonlocal tokens, count
        count += 1
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        req = GenerateRequest(
            request_id=f"pd-{tag}-{count}",
            prompt_token_ids=[rng.randrange(1, 500) for _ in range(prompt_len)],
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        sent = time.perf_counter()
        await nc.publish(subjects.GENERATE, encode_json(req), reply=inbox)
        last = None
        index = 0
        try:
            while True:
                msg = await sub.next_msg(timeout=120)
                event = json.loads(msg.data)
                now = time.perf_counter()
                if event["type"] != "token":
                    if event["type"] == "error":
                        raise RuntimeError(f"request failed: {event}")
                    return
                tokens += 1
                if last is None and not chat:
                    long_ttft.append(now - sent)
                if last is not None and chat:
                    gaps.append(now - last)
                    if index == 1:
                        handover_gaps.append(now - last)
                last = now
                index += 1
        finally:
            await sub.unsubscribe()

    async def chat_client() -> None:
        while time.perf_counter() < stop_at:
            await one(CHAT_PROMPT, CHAT_TOKENS, chat=True)

    async def long_arrivals() -> None:
        i = 0
        tasks = []
        while time.perf_counter() < stop_at:
            tasks.append(
                asyncio.create_task(one(LONG_PROMPTS[i % len(LONG_PROMPTS)], LONG_TOKENS, False))
            )
            i += 1
            await asyncio.sleep(LONG_EVERY_S)
        await asyncio.gather(*tasks)

    started = time.perf_counter()
    try:
        await _wait_healthy(nc)
        started = time.perf_counter()
        stop_at = started + duration
        await asyncio.gather(*(chat_client() for _ in range(CHAT_STREAMS)), long_arrivals())
        elapsed = time.perf_counter() - started
        pulls: list[tuple[int, float, float]] = []
        if disaggregated:
            worker = json.loads(
                (await nc.request(subjects.health("worker", "1"), b"", timeout=10)).data
            )
            pulls = [(int(b), float(s), float(c)) for b, s, c in worker.get("kv_recent_pulls", [])]
    finally:
        await nc.close()
    out: dict[str, Any] = {
        "chat_itl_p50": _pct(gaps, 0.5),
        "chat_itl_p99": _pct(gaps, 0.99),
        "output_tokens_per_s": tokens / elapsed,
        "long_ttft_p50": _pct(long_ttft, 0.5),
        "handover_gap_p50": _pct(handover_gaps, 0.5) if disaggregated else None,
    }
    long_pulls = [(b, s, c) for b, s, c in pulls if b >= LONG_PULL_BYTES]
    chat_pulls = [s for b, s, _ in pulls if b < LONG_PULL_BYTES]
    if chat_pulls:
        out.update(
            chat_pulls=len(chat_pulls),
            chat_pull_s_p50=_pct(chat_pulls, 0.5),
            chat_pull_s_p99=_pct(chat_pulls, 0.99),
        )
    if long_pulls:
        seconds = [s for _, s, _ in long_pulls]
        moved = sum(b for b, _, _ in long_pulls)
        gbps = moved / sum(c for _, _, c in long_pulls) / 1e9
        biggest = max(b for b, _, _ in long_pulls)
        out.update(
            kv_pulls=len(pulls),
            long_pulls=len(long_pulls),
            long_pull_s_p50=_pct(seconds, 0.5),
            long_pull_s_p99=_pct(seconds, 0.99),
            long_pull_gb_per_s=gbps,
            long_pull_max_bytes=biggest,
            real_prompt_bytes=biggest * OURO_LAYERS // SIM_KV_LAYERS,
            real_prompt_s_at_measured=biggest * OURO_LAYERS / SIM_KV_LAYERS / (gbps * 1e9),
        )
    return out


async def _wait_healthy(nc: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = await nc.request(subjects.health("admission"), b"", timeout=5)
            shards = json.loads(msg.data)["shards"]
            if {"0", "1"} <= {sid for sid, s in shards.items() if s["healthy"]}:
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the two shards did not become healthy")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(c: dict[str, Any]) -> list[str]:
    """The comparison's section of report.md."""
    lines = [f"## {c['title']}", "", c["question"], "", *(f"- {n}" for n in c["notes"]), ""]
    if c.get("error"):
        return [*lines, f"**Failed**: `{c['error']}`", ""]
    header = ["repeat", "arm", "SIM chat ITL p50 ms", "SIM chat ITL p99 ms", "SIM out tok/s",
              "SIM long TTFT p50 s", "SIM handover gap p50 ms", "chat pull p50 / p99 ms (n)",
              "long pull p50 / p99 ms (n)", "GB/s", "moved / real prompt MB",
              "est. real prompt s"]  # fmt: skip
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in c["runs"]:
        chat = pull = real = moved = gbps = "-"
        if r.get("chat_pull_s_p50") is not None:
            chat = f"{_ms(r['chat_pull_s_p50'])} / {_ms(r['chat_pull_s_p99'])} ({r['chat_pulls']})"
        if r.get("long_pull_s_p50") is not None:
            pull = f"{_ms(r['long_pull_s_p50'])} / {_ms(r['long_pull_s_p99'])} ({r['long_pulls']})"
            gbps = f"{r['long_pull_gb_per_s']:.2f}"
            moved = f"{r['long_pull_max_bytes'] / 1e6:.0f} / {r['real_prompt_bytes'] / 1e6:.0f}"
            real = f"{r['real_prompt_s_at_measured']:.2f}"
        gap = r.get("handover_gap_p50")
        lines.append(
            f"| {r['repeat']} | {r['arm']} | {_ms(r['chat_itl_p50'])} | {_ms(r['chat_itl_p99'])}"
            f" | {r['output_tokens_per_s']:.0f} | {r['long_ttft_p50'] or 0:.2f} | "
            f"{_ms(gap)} | {chat} | {pull} | {gbps} | {moved} | {real} |"
        )
    lines += ["", "| target | per repeat | median | reached |", "|---|---|---|---|"]
    for t in c["ratios"]:
        per = ", ".join(f"{v:.2f}" for v in t["per_repeat"])
        reached = "**yes**" if t["reached"] else "**no**"
        lines.append(f"| {t['label']} | {per} | {t['median']:.2f} | {reached} |")
    lines.append("")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"
