"""The online ``rlt generate``: requests over NATS to a running deployment (``rlt up`` or
compose), streamed text (or ``--json`` terminal events) on stdout."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

import nats

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from services.client import RetryPolicy, resolve_client_url, stream_requests
from services.common.flags import parse_prompt_ids
from services.launcher.settings import ClientSettings
from services.runtime.bus import encode_json, redact_url


def requests_from_args(args: argparse.Namespace) -> list[GenerateRequest]:
    """One request per positional text, --prompt and --prompt-ids, in that order."""
    common = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "min_loops": args.min_loops,
        "max_loops": args.max_loops,
        "exit_threshold": args.exit_threshold,
        "ignore_eos": args.ignore_eos,
    }
    run = uuid.uuid4().hex[:8]
    texts = [*args.text, *args.prompt]
    out = [
        GenerateRequest(request_id=f"cli-{run}-{i}", prompt=t, **common)
        for i, t in enumerate(texts)
    ]
    for j, ids in enumerate(args.prompt_ids):
        out.append(
            GenerateRequest(
                request_id=f"cli-{run}-{len(texts) + j}",
                prompt_token_ids=parse_prompt_ids(ids),
                **common,
            )
        )
    return out


def main_generate_online(args: argparse.Namespace) -> int:
    requests = requests_from_args(args)
    if not requests:
        print("rlt generate: give a prompt (TEXT, --prompt or --prompt-ids)", file=sys.stderr)
        return 2
    return generate(ClientSettings.from_args(args), requests)


def generate(settings: ClientSettings, requests: list[GenerateRequest]) -> int:
    """Sends ``requests`` and prints their events; 1 when any ended in an error."""

    def on_event(_index: int, event: TokenEvent | FinishedEvent | ErrorEvent) -> None:
        if settings.json:
            if not isinstance(event, TokenEvent):
                print(encode_json(event).decode(), flush=True)
        elif isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, ErrorEvent):
            print(f"error [{event.code}] {event.request_id}: {event.message}", file=sys.stderr)
        else:
            print(flush=True)  # end of this request's streamed text

    url = resolve_client_url(settings.nats_url, settings.tenant)
    try:
        retry = RetryPolicy(max_attempts=max(1, settings.retries + 1))
        results = asyncio.run(
            stream_requests(
                url,
                requests,
                timeout=settings.timeout_s,
                on_event=on_event,
                retry=retry,
                tenant=settings.tenant,
            )
        )
    except (OSError, nats.errors.Error, ValueError) as exc:
        print(f"rlt generate: cannot reach NATS at {redact_url(url)}: {exc!r}", file=sys.stderr)
        return 1
    return 1 if any(isinstance(e, ErrorEvent) for e in results) else 0
