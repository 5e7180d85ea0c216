"""Token-sparse windows chosen on the device ahead of their opening: the device choice equals
the host's (``choose_active``: the prompt's last position, then the highest scores, equal
scores to the lower position, NaN last) for many windows at once; in an engine run every
window opens with its choice made ahead (no wait of its own), and the tokens equal the
serial oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.passes.sparse_prefill import choose_active
from services.worker.passes.window_choice import choose_on_device
from tests.engine_harness import assert_matches_oracle, oracle_result
from tests.engine_strategies import VOCAB_TRAINED, D


@st.composite
def windows(draw: st.DrawFn) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    """(candidates ascending, scores with ties and NaN, tokens kept, forced position)."""
    out, base = [], 0
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 12))
        picks = draw(st.lists(st.integers(0, 29), min_size=n, max_size=n, unique=True))
        candidates = np.sort(np.array(picks, dtype=np.int64)) + base
        base += 30
        scores = np.array(
            draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, float("nan")]), min_size=n,
                          max_size=n)),
            dtype=np.float32,
        )  # fmt: skip
        keep = draw(st.integers(1, n))
        forced = int(candidates[-1]) if draw(st.booleans()) else -1
        out.append((candidates, scores, keep, forced))
    return out


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(ws=windows())
def test_the_device_choice_equals_the_hosts(ws) -> None:
    sizes = [c.size for c, _, _, _ in ws]
    got = choose_on_device(
        torch.from_numpy(np.concatenate([c for c, _, _, _ in ws])),
        torch.from_numpy(np.repeat(np.arange(len(ws)), sizes)),
        torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), dtype=torch.int64),
        torch.from_numpy(np.concatenate([s for _, s, _, _ in ws])),
        torch.tensor([k for _, _, k, _ in ws]),
        torch.tensor([f for _, _, _, f in ws]),
        total=sum(k for _, _, k, _ in ws),
        span=30 * len(ws) + 1,
    )
    want = np.concatenate([choose_active(c, s, k, f) for c, s, k, f in ws])
    assert got.tolist() == want.tolist()


@pytest.mark.oracle
def test_every_window_opens_with_its_choice_made_ahead(toy_model, oracle) -> None:
    """Several prompts of several windows, chunked and interleaved (WCPB, async): each
    window's sparse loops open with the choice made after the batch that wrote its last
    scores, none waits for the device, and the tokens equal the oracle's."""
    config = SchedulerConfig(
        block_size=4, num_blocks=400, max_num_seqs=3, max_num_batched_tokens=12,
        prefill_chunk_size=5, wavefront_chunked_prefill=True, sparse_window=8,
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=5, temperature=0.0, exit_threshold=0.7, ignore_eos=True,
        token_sparse_prefill=True, prefill_retention=[1.0, 0.5, 0.5, 0.25],
    )  # fmt: skip
    prompts = {
        f"p{k}": [(13 * i + 5 * k + 1) % VOCAB_TRAINED + 1 for i in range(n)]
        for k, n in enumerate((37, 21, 50))
    }
    engine = LLMEngine(toy_model, config)
    for rid, prompt in prompts.items():
        engine.core.add_request(rid, prompt, params)
    finished = {e.request_id: e for e in engine.run_until_done() if hasattr(e, "finish_reason")}
    sparse = engine.runner.sparse
    windows_opened = sum(-(-n // 8) for n in map(len, prompts.values())) * 3  # loops 1..3
    assert sparse.num_chosen_waiting == 0
    assert sparse.num_chosen_ahead == windows_opened
    compared = 0
    for rid, prompt in prompts.items():
        want = oracle_result(oracle, prompt, params.resolve(D, 512), config)
        compared += assert_matches_oracle(finished[rid], want, rid)
    assert compared > 0
