"""``rlt check-checkpoint DIR``: is a downloaded Ouro checkpoint one rlt runs as HF does?

Loads the directory the way the services do, prints which files were read and what each
config field resolved to (from the file, or HF's default), the request defaults and end of
sequence ids, the tokenizer's special-token behaviour, then loads the weights and generates
one token. Anything rlt refuses ends the check with the reason and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.common.config_error import ConfigError
from services.common.flags import device_from_args
from services.common.generation_config import GENERATION_CONFIG_FILE
from services.common.model_config import HF_DEFAULTS, OuroConfig, config_field_report
from services.common.tokenizer import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TextCodec,
)
from services.common.tool_template import template_tools
from services.engine.engine import LLMEngine
from services.worker.model.loader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, CheckpointError
from services.worker.model.ouro import OuroModel

_FILE_ROLES = {
    CONFIG_FILE: "model shape, RoPE, loops, early_exit_threshold, eos",
    GENERATION_CONFIG_FILE: "eos ids and request sampling defaults",
    TOKENIZER_FILE: "the tokenizer pipeline and what encode() adds",
    TOKENIZER_CONFIG_FILE: "special tokens and the chat template",
    CHAT_TEMPLATE_FILE: "the chat template (wins over tokenizer_config.json's)",
    SINGLE_FILE: "weights",
    INDEX_FILE: "weights, sharded",
}
_SHOWN_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "total_ut_steps",
    "early_exit_threshold",
    "tie_word_embeddings",
    "torch_dtype",
)


def run_check(args: argparse.Namespace) -> int:
    out = sys.stdout
    try:
        return check_checkpoint(Path(args.dir), args, out)
    except (ConfigError, CheckpointError) as exc:
        print(f"refused: {exc}", file=out)
        return 1
    except RequestError as exc:  # e.g. a tokenizer whose ids the model's vocabulary lacks
        print(f"refused: {exc.message}", file=out)
        return 1


def check_checkpoint(ckpt: Path, args: argparse.Namespace, out: TextIO) -> int:
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory")
    print(f"checkpoint {ckpt}", file=out)
    _print_files(ckpt, out)
    cfg = OuroConfig.from_checkpoint(ckpt)
    raw = json.loads((ckpt / CONFIG_FILE).read_text(encoding="utf-8"))
    _print_config(cfg, raw, out)
    limits = ModelLimits.from_model_config(cfg)
    _print_defaults(cfg, limits, out)
    codec = TextCodec.from_checkpoint(ckpt)
    prompt = _print_tokenizer(codec, cfg, out)

    device, dtype = device_from_args(args)
    start = time.perf_counter()
    model = OuroModel.from_checkpoint(ckpt, dtype=dtype, device=device)
    print(f"weights: loaded and checked in {time.perf_counter() - start:.1f} s", file=out)
    blocks = (-(-len(prompt) // 16) + 1) * cfg.total_ut_steps
    config = SchedulerConfig(max_num_seqs=1, block_size=16, num_blocks=blocks)
    engine = LLMEngine(model, config)
    (finished,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    token = finished.token_ids[0]
    text = codec.decode([token]) if codec else ""
    print(
        f"one token: prompt of {len(prompt)} ids -> token {token} {text!r} "
        f"(exit depth {finished.exit_depths[0]})",
        file=out,
    )
    print("ok", file=out)
    return 0


def _print_files(ckpt: Path, out: TextIO) -> None:
    print("files:", file=out)
    for name, role in _FILE_ROLES.items():
        state = "read" if (ckpt / name).is_file() else "absent"
        print(f"  {name:<30} {state:<7} {role}", file=out)


def _print_config(cfg: OuroConfig, raw: dict, out: TextIO) -> None:
    print("config.json, resolved:", file=out)
    for name in _SHOWN_FIELDS:
        source = "file" if raw.get(name) is not None else "HF default"
        if name in ("head_dim", "torch_dtype") and raw.get(name) is None:
            source = "derived"
        print(f"  {name:<26} {getattr(cfg, name)!r:<14} ({source})", file=out)
    window = raw.get("use_sliding_window", HF_DEFAULTS["use_sliding_window"])
    print(f"  {'attention':<26} full, no sliding window (use_sliding_window={window})", file=out)
    for name, what in config_field_report(raw).items():
        if what != "implemented":
            print(f"  {name:<26} {what}", file=out)


def _print_defaults(cfg: OuroConfig, limits: ModelLimits, out: TextIO) -> None:
    d = limits.defaults
    print(
        f"request defaults: max_tokens={d.max_tokens} temperature={d.temperature} "
        f"top_p={d.top_p} top_k={d.top_k} exit_threshold={d.exit_threshold} min_loops=2 "
        f"max_loops={limits.total_ut_steps}",
        file=out,
    )
    if limits.eos_token_ids:
        print(
            f"end of sequence: {list(limits.eos_token_ids)} (config.json "
            f"{list(cfg.eos_token_ids)}, generation config {list(cfg.generation.eos_token_ids)})",
            file=out,
        )
    else:
        print("end of sequence: none named; requests end at max_tokens or stop ids", file=out)
    for item in cfg.generation.not_applied:
        print(f"  generation config {item}: not applied (rlt has no such option)", file=out)


def _print_tokenizer(codec: TextCodec | None, cfg: OuroConfig, out: TextIO) -> list[int]:
    """Prints the tokenizer's facts; returns the prompt the check generates from."""
    if codec is None:
        print("tokenizer: none (only prompt_token_ids are accepted)", file=out)
        return [cfg.bos_token_id or 0]
    specials = ", ".join(f"{k}={v!r}" for k, v in codec.special_tokens.items()) or "none"
    print(f"tokenizer: encode() adds {codec.added_by_encode()}; {specials}", file=out)
    print(f"chat template: {'yes' if codec.chat_template else 'none'}", file=out)
    if codec.chat_template:
        # which tool-call format the API holds calls to (docs/gateway.md, "Tool calling")
        print(f"tool calls: {template_tools(codec).description}", file=out)
    messages = [{"role": "user", "content": "Hello"}]
    prompt = codec.encode_chat(messages) if codec.chat_template else codec.encode("Hello")
    return prompt or [cfg.bos_token_id or 0]
