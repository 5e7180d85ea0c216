"""Sampled self-speculative decoding: the rejection rule's tokens follow the target
distribution (a chi-square check, as the sampler's own), on its own and through the
engine against the oracle's distribution; and a request's sampled tokens do not depend on
its batch neighbours (docs/speculative.md, "Sampling")."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.sampling import sample_token
from services.common.speculative_sampling import accept_or_resample, filtered_probs
from services.engine.engine import LLMEngine


def _chi2_ok(counts: dict[object, int], expected: dict[object, float], n: int) -> None:
    """Cells expected under 5 draws are pooled; the statistic must stay under about 4.5
    standard deviations above its mean (as tests/test_sampling.py's check)."""
    assert all(expected.get(key, 0.0) > 0.0 for key in counts), "a draw outside the support"
    big = [k for k, p in expected.items() if p * n >= 5]
    small = [k for k, p in expected.items() if p * n < 5]
    cells = [(counts.get(k, 0), expected[k] * n) for k in big]
    if small:
        cells.append((sum(counts.get(k, 0) for k in small), sum(expected[k] for k in small) * n))
    chi2 = sum((o - w) ** 2 / w for o, w in cells)
    dof = len(cells) - 1
    assert dof >= 3
    assert chi2 < dof + 4.5 * math.sqrt(2 * dof), (chi2, dof)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 6, 0.9)]
)
def test_rejection_rule_draws_follow_the_target(temperature, top_k, top_p) -> None:
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(10, generator=gen) * 1.5
    draft = target + torch.randn(10, generator=gen)  # a draft that is often, not always, right
    p = filtered_probs(target, temperature, top_k, top_p)
    n = 6_000
    counts: dict[object, int] = {}
    accepted = 0
    for i in range(n):
        seed = 1000 + i  # a request per draw: seed and index both vary
        x = sample_token(
            draft, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, output_index=i
        )
        token = accept_or_resample(
            target,
            draft,
            x,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            output_index=i,
        )
        accepted += token == x
        counts[token] = counts.get(token, 0) + 1
    assert 0.05 * n < accepted < 0.98 * n  # both branches ran
    _chi2_ok(counts, {t: float(p[t]) for t in range(10) if p[t] > 0}, n)


@pytest.mark.unit
def test_identical_distributions_always_accept() -> None:
    logits = torch.randn(16, generator=torch.Generator().manual_seed(3))
    for i in range(200):
        x = sample_token(logits, temperature=0.9, top_k=0, top_p=1.0, seed=i, output_index=i)
        token = accept_or_resample(
            logits, logits, x, temperature=0.9, top_k=0, top_p=1.0, seed=i, output_index=i
        )
        assert token == x


PROMPT = [17, 4, 250, 31]
TOP_K = 3
TEMPERATURE = 1.0


def _params(seed: int, speculative: bool = True) -> SamplingParams:
    # fixed depth: every generated position is drafted and verified (no exit by the draft)
    return SamplingParams(
        max_tokens=3,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        seed=seed,
        min_loops=1,
        exit_threshold=1.0,
        ignore_eos=True,
        speculative=speculative,
    )


def _oracle_joint(oracle) -> dict[object, float]:
    """P(t0, t1, t2) of plain decoding: the oracle's logits with each prefix forced."""
    captured: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def forcing(prefix: tuple[int, ...]):
        seen: list[torch.Tensor] = []

        def sampler(logits: torch.Tensor, index: int) -> int:
            seen.append(logits.clone())
            return prefix[index] if index < len(prefix) else int(torch.argmax(logits))

        return seen, sampler

    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in captured:
            seen, sampler = forcing(prefix)
            oracle.generate(
                PROMPT, max_tokens=3, min_loops=1, exit_threshold=1.0, ignore_eos=True,
                sampler=sampler,
            )  # fmt: skip
            captured[prefix] = seen
        logits = captured[prefix][len(prefix)]
        return filtered_probs(logits, TEMPERATURE, TOP_K, 1.0)

    joint: dict[object, float] = {}
    p0 = probs(())
    for t0 in torch.nonzero(p0).flatten().tolist():
        p1 = probs((t0,))
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = probs((t0, t1))
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t0, t1, t2)] = float(p0[t0] * p1[t1] * p2[t2])
    return joint


@pytest.mark.oracle
def test_sampled_speculation_follows_the_oracles_distribution(toy_model, oracle) -> None:
    """2,000 seeded requests, K = 2 drafts with 3 of 4 loops, fixed depth: the joint
    distribution of their three tokens (the first from the prompt, the next two from a
    cycle: a verified draft, then a verified draft or the bonus position) is plain
    decoding's, as the oracle computes it."""
    n = 2000
    engine = LLMEngine(
        toy_model,
        SchedulerConfig(
            block_size=4, num_blocks=2048, max_num_seqs=128, speculative_tokens=2, draft_loops=3
        ),
    )
    for i in range(n):
        engine.add_request(f"r{i}", PROMPT, _params(seed=i))
    events = engine.run_until_done()
    finished = [e for e in events if isinstance(e, FinishedEvent)]
    assert len(finished) == n
    spec = engine.scheduler.spec_stats
    # both branches of the rule ran: drafts accepted and drafts rejected
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    counts: dict[object, int] = {}
    for e in finished:
        key = tuple(e.token_ids)
        counts[key] = counts.get(key, 0) + 1
    _chi2_ok(counts, _oracle_joint(oracle), n)


@pytest.mark.oracle
def test_sampled_speculative_tokens_do_not_depend_on_neighbours(toy_model) -> None:
    """The same seeded request alone and beside others (async, mixed K): the same tokens."""

    def run(neighbours: int) -> list[int]:
        engine = LLMEngine(
            toy_model,
            SchedulerConfig(block_size=4, num_blocks=512, speculative_tokens=3, draft_loops=1),
        )
        params = SamplingParams(
            max_tokens=12, temperature=0.8, seed=5, min_loops=1, exit_threshold=0.6,
            ignore_eos=True,
        )  # fmt: skip
        engine.add_request("target", PROMPT, params)
        for i, _ in zip(range(neighbours), itertools.count()):
            engine.add_request(f"n{i}", [3 + i, 8, 60 + i], _params(seed=100 + i))
        events = engine.run_until_done()
        return next(
            e.token_ids for e in events if isinstance(e, FinishedEvent) and e.request_id == "target"
        )

    alone = run(0)
    assert len(alone) == 12
    assert run(5) == alone
