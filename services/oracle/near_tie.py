"""Near-ties: the only places two correct float32 runs of one request may part ways.

Two runs that batch a request with different neighbours sum in different orders, so their
logits and exit-gate values differ in the last bits (about 1e-6 on the toy models). That can
change a choice only where the choice was that close: the two best scores a token was chosen
from (the raw logits when greedy; the filtered logits over the temperature plus the Gumbel
noise when sampled), the exit rule's ``|cdf - threshold|``, or, under token-sparse
prefill, the score gap between the last token a window kept and the best one it froze. The
oracle tests, the device check and the soak all judge a difference with this one rule: at
such a step it is a near-tie, anywhere else a defect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from messages.sampling import SamplingParams
from services.common.sampling import draw_scores, sample_token
from services.oracle.results import OracleResult
from services.oracle.serial import SerialOracle

# a choice this close (in logits, draw scores or cdf) may go either way under reordering
TIE_EPS = 1e-5
# perturbed oracle runs that look for a KV codec's rounding flip (``explain_divergence``)
JITTER_SEEDS = 16


def near_tie(gap: float, exit_margin: float, depths_agree: bool) -> str | None:
    """Why a difference at one token is a near-tie, or None when it is not one. An exit-margin
    tie may move the exit depth (and then the token too); a gap tie only the token, which is
    chosen after the exit, so the two exit depths must agree."""
    if exit_margin < TIE_EPS:
        return f"exit margin {exit_margin:.1e}"
    if gap < TIE_EPS and depths_agree:
        return f"top-2 gap {gap:.1e}"
    return None


class ChoiceSampler:
    """A ``SerialOracle.generate`` sampler that chooses as the engine does (greedy argmax, or
    the counter-based draw) and records, per token, the gap it was chosen by: the two best
    raw logits when greedy, the two best draw scores when sampled, in float64.

    ``forced[i]``, where given, is taken instead of the choice, so the oracle follows another
    run's path and measures the gaps along it; ``scores`` keeps the last token's scores."""

    def __init__(self, params: SamplingParams, forced: Sequence[int] = ()) -> None:
        self.params = params
        self.forced = list(forced)
        self.gaps: list[float] = []
        self.scores = torch.empty(0, dtype=torch.float64)

    @property
    def sampled(self) -> bool:
        return bool(self.params.temperature)

    def __call__(self, logits: torch.Tensor, index: int) -> int:
        p = self.params
        if self.sampled:
            assert p.temperature is not None and p.seed is not None, "resolved params only"
            draw = {
                "temperature": p.temperature,
                "top_k": p.top_k or 0,
                "top_p": 1.0 if p.top_p is None else p.top_p,
                "seed": p.seed,
                "output_index": index,
            }
            token = sample_token(logits, **draw)
            self.scores = draw_scores(logits, **draw)
        else:
            token = int(torch.argmax(logits))
            self.scores = logits.to(torch.float64)
        self.gaps.append(top2_gap(self.scores))
        return self.forced[index] if index < len(self.forced) else token


def top2_gap(scores: torch.Tensor) -> float:
    if scores.numel() < 2:
        return math.inf
    top = torch.topk(scores.to(torch.float64), 2).values
    return float(top[0] - top[1]) if math.isfinite(float(top[1])) else math.inf


# ----------------------------------------------------------------- one engine run vs the oracle


class Output(Protocol):
    token_ids: list[int]
    exit_depths: list[int]
    finish_reason: str


@dataclass
class Comparison:
    compared: int  # tokens equal in id and exit depth, up to a near-tie if any
    total: int  # tokens the oracle generated
    near_tie: str | None = None  # where the comparison stopped, and why
    mismatch: str | None = None


def compare_with_oracle(
    finished: Output, expected: OracleResult, gaps: Sequence[float] | None = None
) -> Comparison:
    """Token ids and exit depths must equal the oracle's, up to the oracle's first near-tie
    (where the comparison stops). ``gaps[i]``: the gap token i was chosen by, when the oracle
    ran with a sampler that measured it (``ChoiceSampler``); else its raw top-2 logit gap."""
    total = len(expected.steps)
    if expected.selection_margin < TIE_EPS:
        # token-sparse prefill chose its active tokens at a near-tie: every later token may go
        # either way, so nothing is compared
        return Comparison(0, total, f"active-token choice {expected.selection_margin:.1e}")
    tokens, depths = finished.token_ids, finished.exit_depths
    for i, step in enumerate(expected.steps):
        gap = step.top2_gap if gaps is None else gaps[i]
        agree = i < len(depths) and depths[i] == step.exit_depth
        tie = near_tie(gap, step.threshold_margin, agree)
        if tie is not None:
            return Comparison(i, total, f"token {i}: {tie}")
        if i >= len(tokens):
            return Comparison(i, total, mismatch=f"engine stopped after {len(tokens)} tokens")
        if (tokens[i], depths[i]) != (step.token_id, step.exit_depth):
            return Comparison(
                i,
                total,
                mismatch=f"token {i}: engine {tokens[i]}@{depths[i]}, oracle "
                f"{step.token_id}@{step.exit_depth} (top-2 gap {gap:.2e}, exit "
                f"margin {step.threshold_margin:.2e})",
            )
    if tokens != expected.token_ids:
        return Comparison(total, total, mismatch=f"engine went on: {len(tokens)} tokens")
    if finished.finish_reason != expected.finish_reason:
        return Comparison(
            total, total, mismatch=f"finish {finished.finish_reason} vs {expected.finish_reason}"
        )
    return Comparison(total, total)


# ----------------------------------------------------------------- two engine runs, one request


@dataclass
class Divergence:
    """Where two runs of one request first differ, and whether they stood at a near-tie
    there. ``tokens``/``exit_depths``: run a's and run b's at ``index`` (None: that run had
    ended). The gaps and the margin are the oracle's, replaying the path both runs agreed on
    up to ``index``: ``top2_gap`` of the raw logits; ``draw_gap`` of the draw scores (sampled
    rows); ``pair_gap`` between the scores of the two tokens the runs chose (the gap that a
    rounding flip has to cross); ``exit_margin``: the exit rule's ``|cdf - threshold|``."""

    index: int
    tokens: tuple[int | None, int | None]
    exit_depths: tuple[int | None, int | None]
    top2_gap: float = math.nan
    draw_gap: float | None = None
    pair_gap: float = math.nan
    exit_margin: float = math.nan
    near_tie: str | None = None  # the near-tie that explains it; None: a defect
    note: str = ""  # why no near-tie could be measured, when none was


def first_difference(
    a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]
) -> int | None:
    """The first index where the (token ids, exit depths) of two runs differ, or where one
    ended and the other went on; None when they are equal."""
    (ta, da), (tb, db) = a, b
    pairs_a, pairs_b = zip(ta, da, strict=True), zip(tb, db, strict=True)
    for i, (x, y) in enumerate(zip(pairs_a, pairs_b, strict=False)):  # the shorter run
        if x != y:
            return i
    return None if len(ta) == len(tb) else min(len(ta), len(tb))


def explain_divergence(
    oracle: SerialOracle,
    prompt: Sequence[int],
    params: SamplingParams,
    a: tuple[Sequence[int], Sequence[int]],
    b: tuple[Sequence[int], Sequence[int]],
    *,
    kv_layout: str = "last_exited",
    prefill_chunk_size: int | None = None,
    kv_codec: KVCodecArgs | None = None,
) -> Divergence | None:
    """Names the first token where runs ``a`` and ``b`` (token ids, exit depths) of one
    request differ and measures, with the oracle forced along their common path, how close
    the choice there was. None when the runs are equal. ``params``: resolved (seed set).
    ``kv_codec``: the runs' KV codec, which the oracle applies too; under fp8 or int4-delta
    a difference where the oracle itself chooses either run's token and exit once its K/V
    are perturbed at float32's resolution is a codec rounding flip (a code that sits one
    rounding from its boundary), a near-tie of its own."""
    i = first_difference(a, b)
    if i is None:
        return None
    (ta, da), (tb, db) = a, b

    def at(seq: Sequence[int]) -> int | None:
        return seq[i] if i < len(seq) else None

    found = Divergence(i, (at(ta), at(tb)), (at(da), at(db)))
    if None in found.tokens:
        found.note = "one run ended where the other went on: the same stop rule saw the same tokens"
        return found
    depths = oracle.total_ut_steps
    max_loops = params.max_loops or depths
    # the agreed exit depths cap the oracle's loops before token i; a cap the exit rule would
    # not reach ends the token there, as the forced depth
    caps = [depths, *(min(d, max_loops) for d in da[1:i]), max_loops]
    codec = kv_codec or KVCodecArgs()

    def forced_replay(jitter_seed: int | None) -> tuple[OracleResult, ChoiceSampler]:
        sampler = ChoiceSampler(params, forced=ta[:i])
        replay = oracle.generate(
            prompt,
            max_tokens=i + 1,
            min_loops=params.min_loops,
            max_loops=max_loops,
            exit_threshold=params.exit_threshold,
            ignore_eos=True,  # both runs went on past every token before i
            kv_layout=kv_layout,
            prefill_chunk_size=prefill_chunk_size,
            sampler=sampler,
            max_loops_per_token=caps,
            kv_cache_dtype=codec.kv_cache_dtype,
            kv_block_size=codec.kv_block_size,
            kv_int4_anchor_every=codec.kv_int4_anchor_every,
            kv_jitter_seed=jitter_seed,
        )
        return replay, sampler

    replay, sampler = forced_replay(None)
    left = first_difference((replay.token_ids[:i], replay.exit_depths[:i]), (ta[:i], da[:i]))
    if left is not None:
        found.note = f"the oracle left the agreed path at token {left} (exit depth)"
        return found
    step = replay.steps[i]
    found.top2_gap = step.top2_gap
    found.draw_gap = sampler.gaps[i] if sampler.sampled else None
    found.exit_margin = step.threshold_margin
    if ta[i] != tb[i]:
        found.pair_gap = abs(float(sampler.scores[ta[i]] - sampler.scores[tb[i]]))
    found.near_tie = near_tie(found.pair_gap, found.exit_margin, da[i] == db[i])
    if found.near_tie is None and codec.kv_cache_dtype != "auto":
        chosen = {(replay.token_ids[i], replay.exit_depths[i])}
        for seed in range(JITTER_SEEDS):
            jittered, _ = forced_replay(seed)
            if jittered.token_ids[:i] == list(ta[:i]) and jittered.exit_depths[:i] == list(da[:i]):
                chosen.add((jittered.token_ids[i], jittered.exit_depths[i]))
        if {(ta[i], da[i]), (tb[i], db[i])} <= chosen:
            found.near_tie = f"{codec.kv_cache_dtype} rounding flip (the oracle chose both)"
    return found


@dataclass(frozen=True)
class KVCodecArgs:
    """A run's KV codec, as ``SerialOracle.generate`` takes it."""

    kv_cache_dtype: str = "auto"
    kv_block_size: int = 16
    kv_int4_anchor_every: int = 0
