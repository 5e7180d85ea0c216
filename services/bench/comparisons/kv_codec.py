"""``rlt bench --only kv_codec``: the KV codecs (``--kv-cache-dtype``) side by side.

Three questions, per codec (``auto``, ``fp8``, ``int4-delta``):

- bytes: KV bytes per context token over every layer and loop (codes, scales, flags and, for
  int4-delta, a whole full-precision tail block per plane spread over the context), at this
  machine's model's shape and at Ouro-1.4B's, against bf16 and fp32 ``auto``
  (``kernels.kv_codec.bytes_per_token``);
- capacity: the most concurrent 2k-token requests a fixed KV memory holds: the blocks the
  memory holds at the codec's real block bytes (``services.common.fit.blocks_in_memory``;
  int4-delta: with the worker's reserve of tail blocks, which holds the requests' open
  blocks), divided by a request's footprint under the scheduler's own fit rule
  (``KVGeometry``);
- decode speed: tokens/s of greedy fixed-depth decode, on the simulated device (the cost
  model of ``services/worker/sim.py``, Ouro-1.4B on an H100, charging a context token its
  codec's bytes; under int4-delta a pass at loop d reads the codes of its chain, the planes
  from the last anchor at or below d up to d, and the row's tail block) at 1, 32 and 128
  rows x 2k and 8k context with the bytes read per core pass (averaged over the loops), per
  anchor interval of int4-delta (every 1, 2 and 4 of Ouro's 4 loops; 4 is plane 0 alone),
  and in-process on this machine's model (its default anchor interval).
"""

from __future__ import annotations

import time
from typing import Any

from kernels.kv_codec import (
    AUTO,
    CODECS,
    DEFAULT_BATCH_LIMITS,
    FP8,
    INT4_DELTA,
    BatchLimits,
    block_bytes,
    bytes_per_token,
    codec_name,
    open_blocks_bound,
)
from messages.api import TokenEvent
from messages.sampling import SamplingParams
from services.common.config import KVLayout, SchedulerConfig
from services.common.fit import KVGeometry, blocks_in_memory, kv_tokens
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import toy_config
from services.worker.sim import H100_BF16_FLOPS_PER_S, H100_HBM_BYTES_PER_S, SimCostModel

BLOCK_SIZE = 16
CONTEXT = 2048  # the capacity question's request: 2k KV tokens (prompt + answer)
KV_MEMORY_GIB = 40  # the fixed KV memory of the capacity question (Ouro-1.4B, bf16 auto base)
SIM_ROWS = (1, 32, 128)
SIM_CONTEXTS = (2048, 8192)
SIM_ANCHORS = (1, 2, 4)  # int4-delta's anchor intervals over Ouro-1.4B's 4 loops
# in-process on the CPU: what two shared cores finish in minutes
CPU_ROWS = (1, 32)
CPU_CONTEXTS = (256,)
CPU_QUICK_CONTEXTS = (64,)
CPU_DECODE_STEPS = 8


def _shape(cfg: Any) -> dict[str, int]:
    return {
        "layers": cfg.num_hidden_layers,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "planes": cfg.total_ut_steps,
    }


def bytes_table(shapes: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Bytes per context token at CONTEXT (tails included) per shape and codec."""
    rows = []
    for label, s in shapes.items():
        bf16 = bytes_per_token(
            AUTO, s["kv_heads"], s["head_dim"], s["planes"], BLOCK_SIZE, 2, s["layers"], CONTEXT
        )
        for codec, model_bytes in ((AUTO, 4), (AUTO, 2), (FP8, 2), (INT4_DELTA, 2)):
            per = bytes_per_token(
                codec,
                s["kv_heads"],
                s["head_dim"],
                s["planes"],
                BLOCK_SIZE,
                model_bytes,
                s["layers"],
                CONTEXT,
            )
            name = f"{codec} ({'fp32' if model_bytes == 4 else 'bf16'})" if codec == AUTO else codec
            rows.append(
                {"shape": label, "codec": name, "bytes_per_token": per, "vs_bf16": per / bf16}
            )
    return rows


def capacity(s: dict[str, int], kv_bytes: int) -> dict[str, int]:
    """The most concurrent CONTEXT-token requests ``kv_bytes`` of KV hold, per codec."""
    out = {}
    for codec in CODECS:
        block_id = s["layers"] * block_bytes(codec, BLOCK_SIZE, s["kv_heads"], s["head_dim"], 2)
        tail = s["layers"] * block_bytes(AUTO, BLOCK_SIZE, s["kv_heads"], s["head_dim"], 2)
        # a request of CONTEXT KV tokens (prompt CONTEXT - 127, 128 tokens out) under the
        # scheduler's fit rule
        fit = KVGeometry(BLOCK_SIZE, 0, s["planes"])
        footprint = fit.blocks_for(kv_tokens(CONTEXT - 127, 128))
        requests = blocks_in_memory(kv_bytes, block_id) // footprint
        if codec == INT4_DELTA:
            requests = _int4_requests(kv_bytes, block_id, tail, footprint, s["planes"])
        out[codec] = requests
    return out


def _int4_requests(kv_bytes: int, block_id: int, tail: int, footprint: int, planes: int) -> int:
    """The most requests that fit beside the tail reserve of a server that runs that many
    at once (``max_num_seqs``; the default batch of tokens): one tail per ``TAIL_SHARE``
    block ids or what their batches can hold open, whichever is more."""
    requests = blocks_in_memory(kv_bytes, block_id, tail) // footprint  # the share alone
    while True:
        limits = BatchLimits(requests, DEFAULT_BATCH_LIMITS.max_num_batched_tokens)
        bound = open_blocks_bound(planes, BLOCK_SIZE, limits)
        fits = blocks_in_memory(kv_bytes, block_id, tail, bound) // footprint
        if fits >= requests:
            return requests
        requests = fits


def simulated_decode() -> list[dict[str, Any]]:
    """Greedy decode at Ouro-1.4B's fixed depth on the simulated H100: a token is one core
    pass per loop (every row at its context, the loop's plane; int4-delta: the chain from
    the anchor at or below it, per anchor interval) and one coda."""
    cfg = toy_config("1.4b")
    loops = range(cfg.total_ut_steps)
    rows = []
    variants = [(c, a) for c in CODECS for a in (SIM_ANCHORS if c == INT4_DELTA else (0,))]
    for codec, every in variants:
        cost = SimCostModel.for_model(
            cfg,
            kv_cache_dtype=codec,
            block_size=BLOCK_SIZE,
            bytes_per_s=H100_HBM_BYTES_PER_S,
            flops_per_s=H100_BF16_FLOPS_PER_S,
            kv_int4_anchor_every=every,
        )
        for n in SIM_ROWS:
            for ctx in SIM_CONTEXTS:
                read_tokens = [n * cost.kv_tokens_read(ctx, d) for d in loops]
                passes = sum(cost.core_pass_s(n, tokens, n * ctx) for tokens in read_tokens)
                token_s = passes + cost.coda_s(n)
                mean_tokens = sum(read_tokens) / len(read_tokens)
                read = cost.core_weight_bytes + mean_tokens * cost.kv_bytes_per_token
                rows.append(
                    {
                        "codec": codec_name(codec, every, cfg.total_ut_steps),
                        "rows": n,
                        "context": ctx,
                        "tokens_per_s": n / token_s,
                        "bytes_per_pass": read,
                    }
                )
    return rows


def cpu_decode(model: OuroModel, contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Greedy fixed-depth decode tokens/s in process on this machine's model: prompts of
    ``context`` tokens prefilled first, then CPU_DECODE_STEPS engine steps timed."""
    out = []
    for codec in CODECS:
        for n in CPU_ROWS:
            for ctx in contexts:
                blocks = n * model.cfg.total_ut_steps * (-(-(ctx + 64) // BLOCK_SIZE)) + 8
                config = SchedulerConfig(
                    block_size=BLOCK_SIZE,
                    num_blocks=blocks,
                    max_num_seqs=n,
                    max_num_batched_tokens=max(2048, ctx),
                    kv_layout=KVLayout.LAST_EXITED,
                    kv_cache_dtype=codec,
                    async_scheduling=False,
                )
                engine = LLMEngine(model, config)
                params = SamplingParams(
                    max_tokens=CPU_DECODE_STEPS + 8,
                    temperature=0.0,
                    ignore_eos=True,
                    exit_threshold=1.0,
                )
                vocab = min(model.cfg.vocab_size, 500)
                for i in range(n):
                    prompt = [1 + (i * 7 + j) % (vocab - 1) for j in range(ctx)]
                    engine.add_request(f"r{i}", prompt, params)
                produced = 0
                while produced < n:  # every prompt through prefill
                    produced += sum(isinstance(e, TokenEvent) for e in engine.step())
                t0 = time.perf_counter()
                tokens = 0
                for _ in range(CPU_DECODE_STEPS):
                    tokens += sum(isinstance(e, TokenEvent) for e in engine.step())
                wall = time.perf_counter() - t0
                out.append(
                    {"codec": codec, "rows": n, "context": ctx, "tokens_per_s": tokens / wall}
                )
    return out


def _target(workload: str, text: str, value: float, reached: bool) -> dict[str, Any]:
    """One of the issue's targets, computed (no spread: the figures are exact or modelled)."""
    return {
        "workload": workload,
        "target": {"text": text},
        "median": value,
        "min": value,
        "max": value,
        "reached": reached,
    }


def targets(c: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets at Ouro-1.4B's shape."""
    per = {r["codec"]: r["vs_bf16"] for r in c["bytes"] if r["shape"] == "Ouro-1.4B"}
    cap = c["capacity"]["requests"]
    sim = {(r["codec"], r["rows"], r["context"]): r["tokens_per_s"] for r in c["simulated"]}
    loops = toy_config("1.4b").total_ut_steps
    anchor = SchedulerConfig().kv_int4_anchor_every  # the engine's default
    int4 = codec_name(INT4_DELTA, anchor, loops)
    speed = sim[(int4, 32, 2048)] / sim[(AUTO, 32, 2048)]
    return [
        _target("bytes/token", "fp8 KV bytes per token <= 0.55x auto", per[FP8], per[FP8] <= 0.55),
        _target(
            "bytes/token",
            "int4-delta KV bytes per token <= 0.35x auto",
            per[INT4_DELTA],
            per[INT4_DELTA] <= 0.35,
        ),
        _target(
            "capacity",
            "fp8 2k requests >= 1.8x auto",
            cap[FP8] / cap[AUTO],
            cap[FP8] >= 1.8 * cap[AUTO],
        ),
        _target(
            "capacity",
            "int4-delta 2k requests >= 2.5x auto",
            cap[INT4_DELTA] / cap[AUTO],
            cap[INT4_DELTA] >= 2.5 * cap[AUTO],
        ),
        _target(
            "sim 32x2k",
            f"int4-delta decode >= 1.6x auto (simulated H100 cost model), the default "
            f"anchor interval: {int4}",
            speed,
            speed >= 1.6,
        ),
    ]


def run_comparison(model: OuroModel, *, quick: bool = False, **_: Any) -> dict[str, Any]:
    shapes = {"this model": _shape(model.cfg), "Ouro-1.4B": _shape(toy_config("1.4b"))}
    ouro = shapes["Ouro-1.4B"]
    c = {
        "name": "kv_codec",
        "kind": "kv_codec",
        "title": "KV codecs",
        "question": "How many bytes a context token takes, how many 2k-token requests a "
        "fixed KV memory holds, and how fast decode runs, per --kv-cache-dtype?",
        "notes": [
            "simulated device: Ouro-1.4B on an H100 (services/worker/sim.py); under "
            "int4-delta a pass at loop d reads the codes of the planes from the last anchor at "
            "or below d up to d and the row's tail block",
            "in-process (CPU) int4-delta attention is the torch reference; the Triton kernel "
            "runs on CUDA (no GPU has run it yet). CPU tokens/s swing with the shared cores",
        ],
        "bytes": bytes_table(shapes),
        "capacity": {"kv_gib": KV_MEMORY_GIB, "requests": capacity(ouro, KV_MEMORY_GIB << 30)},
        "simulated": simulated_decode(),
        "cpu": cpu_decode(model, CPU_QUICK_CONTEXTS if quick else CPU_CONTEXTS),
        "runs": [],
    }
    c["ratios"] = targets(c)
    return c


def markdown(c: dict[str, Any]) -> list[str]:
    lines = [f"## {c['title']}", "", c["question"], ""]
    if c.get("error"):
        return [*lines, f"**Failed**: `{c['error']}`", ""]
    lines += [f"- {n}" for n in c["notes"]]
    lines += ["", f"### KV bytes per context token ({CONTEXT} tokens, bs {BLOCK_SIZE})", ""]
    lines += ["| shape | codec | bytes / token | vs bf16 auto |", "|---|---|---|---|"]
    for r in c["bytes"]:
        lines.append(
            f"| {r['shape']} | {r['codec']} | {r['bytes_per_token']:,.0f} | {r['vs_bf16']:.3f} |"
        )
    cap = c["capacity"]
    base = cap["requests"][AUTO]
    lines += ["", f"### Concurrent {CONTEXT}-token requests in {cap['kv_gib']} GiB (Ouro-1.4B)", ""]
    lines += ["| codec | requests | vs auto |", "|---|---|---|"]
    for codec, n in cap["requests"].items():
        lines.append(f"| {codec} | {n} | {n / base:.2f} |")
    lines += ["", "### Decode tokens/s, simulated H100 (Ouro-1.4B, bf16 weights)", ""]
    lines += ["| codec | rows | context | tokens/s | vs auto | GB read per pass |"]
    lines += ["|---|---|---|---|---|---|"]
    sim = {(r["codec"], r["rows"], r["context"]): r for r in c["simulated"]}
    for (codec, n, ctx), r in sim.items():
        auto = sim[(AUTO, n, ctx)]["tokens_per_s"]
        lines.append(
            f"| {codec} | {n} | {ctx} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / auto:.2f} | {r['bytes_per_pass'] / 1e9:.2f} |"
        )
    lines += ["", "### Decode tokens/s in process (this machine's model, CPU)", ""]
    lines += ["| codec | rows | context | tokens/s |", "|---|---|---|---|"]
    for r in c["cpu"]:
        lines.append(f"| {r['codec']} | {r['rows']} | {r['context']} | {r['tokens_per_s']:.1f} |")
    lines += ["", "### Targets", "", "| target | measured | reached |", "|---|---|---|"]
    for t in c["ratios"]:
        reached = "yes" if t["reached"] else "**no**"
        lines.append(f"| {t['target']['text']} | {t['median']:.2f} | {reached} |")
    return [*lines, ""]
