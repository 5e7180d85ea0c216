"""Token-sparse prefill against FlashLoop's own reference (``flashloop_torch``'s
LoopFreezeIntervention, the published package, unmodified), with one window over the whole
prompt, where rlt's rule is exactly FlashLoop's.

The intervention hooks Hugging Face's Ouro modules (``model.model.layers[i].self_attn``'s
forward with a ``current_ut`` argument, each decoder layer's forward, ``model.model.norm``
after every loop, a cache whose ``key_cache`` / ``value_cache`` lists are indexed
``loop * num_layers + layer``). HF's Ouro code is remote code on the Hub and cannot be
fetched here, so the host (``tests/hf_ouro.py``) is a module written for the tests with
HF's structure: the same module names, forward arguments and cache indexing, and Ouro's
layer math. It is not HF's file. It loads the toy checkpoint's safetensors in float32.

rlt breaks score ties towards the lower prompt position; FlashLoop takes ``torch.topk``'s
order. Random weights give distinct scores, and each test checks the oracle's selection
margin, so a near-tie would fail loudly instead of comparing two legitimate choices.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flashloop_torch.token_updates import LoopFreezeIntervention

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.sparse_prefill import FLASHLOOP_RETENTION
from services.engine.engine import LLMEngine
from services.oracle import SerialOracle, SparseSetting
from services.worker.model.ouro import OuroModel
from tests.hf_ouro import HostedOuro

pytestmark = pytest.mark.oracle

# long enough that ceil(0.25 * P) and ceil(0.1 * P) keep a real share, short enough for CPU
PROMPTS = [
    [(7 * i + 3) % 500 + 1 for i in range(37)],
    [(13 * i + 5) % 480 + 2 for i in range(64)],
    [(31 * i + 11) % 509 + 1 for i in range(101)],
]
NEW_TOKENS = 8
LOGPROB_TOL = 1e-4
MARGIN = 1e-5  # score gap at a window's cut below which the choice could legitimately flip


def _flashloop(checkpoint: Path, prompt: list[int]) -> tuple[torch.Tensor, list[int], dict]:
    host = HostedOuro(checkpoint)
    freeze = LoopFreezeIntervention(
        host, fraction_loop3=FLASHLOOP_RETENTION[2], fraction_loop4=FLASHLOOP_RETENTION[3]
    )
    try:
        first, tokens = host.greedy(prompt, NEW_TOKENS)
        return first, tokens, freeze.audit()
    finally:
        freeze.close()


def _whole_prompt(prompt: list[int]) -> SparseSetting:
    return SparseSetting(window=max(len(prompt), 1), retention=FLASHLOOP_RETENTION)


@pytest.fixture(scope="module")
def references(toy_checkpoint: Path) -> dict[int, tuple[torch.Tensor, list[int], dict]]:
    return {i: _flashloop(toy_checkpoint, p) for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_oracle_equals_flashloop_loopfreeze(
    toy_checkpoint: Path, oracle: SerialOracle, references: dict, index: int
) -> None:
    prompt = PROMPTS[index]
    first, tokens, audit = references[index]
    # the reference really froze tokens: loop 3 kept ceil(0.25 P), loop 4 ceil(0.1 P)
    assert audit["active_counts"] == {
        "3": math.ceil(len(prompt) * 0.25),
        "4": math.ceil(len(prompt) * 0.1),
    }
    assert audit["mask_nested"]
    result = oracle.generate(
        prompt,
        max_tokens=NEW_TOKENS,
        exit_threshold=1.0,
        ignore_eos=True,
        sparse_prefill=_whole_prompt(prompt),
    )
    assert result.selection_margin > MARGIN
    step = result.steps[0]
    ours = dict(step.top_logprobs)
    for token_id, logprob in ours.items():
        assert abs(float(first[token_id]) - logprob) < LOGPROB_TOL, (token_id, index)
    assert result.token_ids == tokens
    # and the freeze mattered: the dense first token's distribution differs
    dense = oracle.generate(prompt, max_tokens=1, exit_threshold=1.0, ignore_eos=True)
    dense_top = dict(dense.steps[0].top_logprobs)
    shared = set(dense_top) & set(ours)
    assert max(abs(dense_top[t] - ours[t]) for t in shared) > 1e-3


@pytest.mark.parametrize(("chunk", "budget"), [(512, 2048), (16, 24), (7, 5)])
def test_engine_equals_flashloop_loopfreeze(
    toy_model: OuroModel, references: dict, chunk: int, budget: int
) -> None:
    """The engine, one window over each prompt (W >= P), in wavefront prefill of several
    chunk sizes and budgets (small budgets cut each sparse loop into fragments): the first
    token's log-probabilities within 1e-4 of FlashLoop's and the same greedy tokens."""
    config = SchedulerConfig(
        block_size=16,
        num_blocks=256,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=budget,
        sparse_window=128,
        token_sparse_prefill=True,
    )
    engine = LLMEngine(toy_model, config)
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, exit_threshold=1.0, ignore_eos=True, logprobs=20
    )
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"p{index}", prompt, params)
    events = engine.run_until_done()
    first = {e.request_id: e for e in events if isinstance(e, TokenEvent) and e.index == 0}
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    for index in range(len(PROMPTS)):
        reference, tokens, _ = references[index]
        logprobs = first[f"p{index}"].logprobs
        assert logprobs is not None and len(logprobs.top_logprobs) == 20
        for top in logprobs.top_logprobs:
            assert abs(float(reference[top.token_id]) - top.logprob) < LOGPROB_TOL
        assert finished[f"p{index}"].token_ids == tokens
    # only the active tokens ran: 2 dense loops, then a quarter and a tenth
    dense = sum(len(p) for p in PROMPTS) * 4
    sparse = sum(2 * len(p) + math.ceil(len(p) * 0.25) + math.ceil(len(p) * 0.1) for p in PROMPTS)
    assert engine.scheduler.stats.num_prefill_rows == sparse
    assert engine.scheduler.stats.num_prefill_rows_saved == dense - sparse
