"""``rlt generate --offline``: the in-process engine behind the same flags as the client."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import msgspec

from messages.api import FinishedEvent, TokenEvent
from messages.errors import RequestError
from services.common.flags import (
    device_from_args,
    parse_prompt_ids,
    sampling_params_from_args,
    scheduler_config_from_args,
)
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.scheduler.core.batch import ScheduledBatch
from services.worker.model.toy import ensure_checkpoint


def collect_prompts(args: argparse.Namespace, codec: TextCodec | None) -> list[list[int]]:
    """Prompts in input order: positional text, then --prompt, then --prompt-ids."""
    texts = list(getattr(args, "text", []) or []) + list(args.prompt)
    if texts and codec is None:
        raise SystemExit("this checkpoint has no tokenizer.json; use --prompt-ids")
    prompts = [codec.encode(t) for t in texts] if codec else []
    prompts += [parse_prompt_ids(s) for s in args.prompt_ids]
    if not prompts:
        raise SystemExit("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    return prompts


def build_offline_engine(
    args: argparse.Namespace, on_batch: Callable[[ScheduledBatch], None] | None = None
) -> tuple[LLMEngine, TextCodec | None, list[list[int]]]:
    """Engine, text codec and prompts from the shared CLI flags (toy checkpoint by default)."""
    checkpoint = ensure_checkpoint(args.checkpoint)
    codec = TextCodec.from_checkpoint(checkpoint)
    prompts = collect_prompts(args, codec)
    device, dtype = device_from_args(args)
    engine = LLMEngine.from_checkpoint(
        checkpoint,
        scheduler_config_from_args(args),
        dtype=dtype,
        device=device,
        codec=codec,
        on_batch=on_batch,
    )
    return engine, codec, prompts


def run_offline(args: argparse.Namespace) -> int:
    engine, _, prompts = build_offline_engine(args)
    params = sampling_params_from_args(args)
    ids = [f"offline-{i}" for i in range(len(prompts))]
    errors = 0
    results: dict[str, FinishedEvent] = {}
    for request_id, prompt in zip(ids, prompts, strict=True):
        try:
            engine.add_request(request_id, prompt, params)
        except RequestError as exc:
            errors += 1
            print(f"{request_id}: error: {exc.message}", file=sys.stderr)
    while engine.has_unfinished_requests():
        for event in engine.step():
            # the same incremental text as a stream over NATS (EngineCore's output processor)
            if isinstance(event, TokenEvent) and not args.json and len(ids) == 1:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, FinishedEvent):
                results[event.request_id] = event
    for request_id in ids:
        event = results.get(request_id)
        if event is None:
            continue
        if args.json:
            print(msgspec.json.encode(event).decode())
        elif len(ids) == 1:
            print()
        else:
            print(f"[{request_id}] {event.text or event.token_ids}")
    return 1 if errors else 0
