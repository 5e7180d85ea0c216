"""The soak's output check (``scripts/soak.py --adversary``): every honest stream is
consistent, and its output equals the in-process engine's for the same request (a prefix of
it when the request was aborted).

Two correct float32 runs that batch a request with different neighbours may still part ways
at a near-tie (``services/oracle/near_tie.py``). So every output that differs is named, with
its first differing token, both runs' tokens and exit depths there, and the gaps the oracle
measures there along the path both runs agreed on; one at a near-tie is counted apart
(``near_ties``), anything else is ``altered`` and fails the soak.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from messages.api import FinishedEvent, StreamEvent, TokenEvent
from messages.sampling import SamplingParams

if TYPE_CHECKING:  # the engine loads only once outputs are checked
    from services.common.config import SchedulerConfig
    from services.oracle import SerialOracle

# the request fields the soak sets (scripts/soak.py), in the order a report lists them
PARAM_FIELDS = ("max_tokens", "temperature", "seed", "min_loops", "exit_threshold", "ignore_eos")


class Tally(Protocol):
    verified: int
    altered: int
    near_ties: int
    divergences: list[dict[str, Any]]


def stream_problem(events: list[StreamEvent], request_id: str) -> str | None:
    """What is wrong with one stream's events, or None: only its own request id, and its
    tokens in order without repeats."""
    ids = {e.request_id for e in events}
    if ids != {request_id}:
        return f"foreign events in the stream: request ids {sorted(ids)}"
    indices = [e.index for e in events if isinstance(e, TokenEvent)]
    if indices != sorted(set(indices)):
        return f"token events out of order or repeated: indices {indices}"
    return None


def params_of(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: body[k] for k in PARAM_FIELDS})


def verify_outputs(
    done: list[tuple[FinishedEvent, dict[str, Any]]],
    checkpoint: Path,
    engine_args: list[str],
    tally: Tally,
) -> None:
    """Compares each finished honest output (with the request body that asked for it) with
    the in-process engine's, configured by ``engine_args`` as the services were."""
    if not done:
        return
    from services.cli import build_parser
    from services.common.flags import scheduler_config_from_args
    from services.engine.engine import LLMEngine

    config = scheduler_config_from_args(
        build_parser().parse_args(["service", "worker", *engine_args])
    )
    expected = LLMEngine.from_checkpoint(checkpoint, config).generate(
        [b["prompt_token_ids"] for _, b in done], [params_of(b) for _, b in done]
    )
    differing = []
    for (got, body), want in zip(done, expected, strict=True):
        tally.verified += 1
        n = len(got.token_ids) if got.finish_reason == "abort" else len(want.token_ids)
        if (got.token_ids, got.exit_depths) != (want.token_ids[:n], want.exit_depths[:n]):
            differing.append((got, body, want))
    if not differing:
        return
    from services.oracle import SerialOracle

    oracle = SerialOracle(checkpoint)
    for got, body, want in differing:
        record = describe(oracle, config, got, body, want)
        tally.divergences.append(record)
        if record["near_tie"]:
            tally.near_ties += 1
        else:
            tally.altered += 1


def describe(
    oracle: SerialOracle,
    config: SchedulerConfig,
    got: FinishedEvent,
    body: dict[str, Any],
    want: FinishedEvent,
) -> dict[str, Any]:
    """One differing output as the report lists it: the request, where the services' output
    (``services``) and the in-process engine's (``engine``) first differ, and the oracle's
    gaps and exit margin there (``services/oracle/near_tie.py``, ``Divergence``)."""
    from services.common.config import KVLayout
    from services.oracle.near_tie import KVCodecArgs, explain_divergence

    shared = config.kv_layout == KVLayout.SHARED
    n = len(got.token_ids) if got.finish_reason == "abort" else len(want.token_ids)
    found = explain_divergence(
        oracle,
        body["prompt_token_ids"],
        params_of(body),
        (got.token_ids, got.exit_depths),
        (want.token_ids[:n], want.exit_depths[:n]),
        kv_layout=config.kv_layout.value,
        prefill_chunk_size=config.prefill_chunk_size if shared else None,
        kv_codec=KVCodecArgs(config.kv_cache_dtype, config.block_size, config.kv_int4_anchor_every),
    )
    assert found is not None, "only outputs that differ are described"
    return {
        "request_id": body["request_id"],
        "params": {k: body[k] for k in PARAM_FIELDS},
        "prompt_token_ids": body["prompt_token_ids"],
        "finish_reason": {"services": got.finish_reason, "engine": want.finish_reason},
        "index": found.index,
        "tokens": dict(zip(("services", "engine"), found.tokens, strict=True)),
        "exit_depths": dict(zip(("services", "engine"), found.exit_depths, strict=True)),
        "top2_gap": _number(found.top2_gap),
        "draw_gap": _number(found.draw_gap),
        "pair_gap": _number(found.pair_gap),
        "exit_margin": _number(found.exit_margin),
        "near_tie": found.near_tie,
        "note": found.note,
    }


def _number(x: float | None) -> float | str | None:
    """A gap as JSON holds it: non-finite values as text."""
    if x is None or math.isfinite(x):
        return x
    return str(x)
