"""The request-fit rule is written once (services/common/fit.py): admission, which refuses
early, and the scheduler, which has the last word, agree on every request at the edges."""

from __future__ import annotations

import itertools
import json

import pytest

from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.admission.core import AdmissionConfig, AdmissionCore, AdmissionError
from services.common.config import KVLayout, ModelLimits, SchedulerConfig
from services.common.fit import KVGeometry, check_request_fits
from services.scheduler.core.scheduler import Scheduler

pytestmark = pytest.mark.unit

LIMITS = ModelLimits(total_ut_steps=4, vocab_size=64, max_position_embeddings=40, eos_token_ids=())


def verdicts(layout: KVLayout, num_blocks: int, block_size: int) -> list[tuple[int, int, str]]:
    """(prompt, max_tokens, error or "") from admission and from the scheduler, over the
    region where both limits bite; asserts the two sides agree on each."""
    config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks, kv_layout=layout)
    admission = AdmissionCore(
        LIMITS,
        None,
        AdmissionConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            num_kv_planes=config.num_planes(LIMITS.total_ut_steps),
        ),
    )
    out = []
    for n, (prompt, max_tokens) in enumerate(itertools.product(range(1, 42, 3), range(1, 42, 4))):
        body = {"prompt_token_ids": [1] * prompt, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            admission.prepare(json.dumps(body).encode())
            online = ""
        except AdmissionError as exc:
            online = exc.message
        scheduler = Scheduler(config, LIMITS)
        try:
            scheduler.add_request(f"r{n}", [1] * prompt, SamplingParams(max_tokens=max_tokens))
            offline = ""
        except RequestError as exc:
            offline = exc.message
        assert online == offline, (prompt, max_tokens)
        out.append((prompt, max_tokens, online))
    return out


@pytest.mark.parametrize("layout", [KVLayout.LAST_EXITED, KVLayout.SHARED])
def test_admission_and_scheduler_agree_on_what_fits(layout: KVLayout) -> None:
    # 12 blocks of 4 tokens: 48 positions in one plane, 12 over four planes
    found = verdicts(layout, num_blocks=12, block_size=4)
    kinds = {msg.split(" ")[0] for _, _, msg in found if msg}
    # one shared plane of 48 slots outlasts the 40 positions; four planes of 12 do not
    assert kinds == ({"prompt"} if layout is KVLayout.SHARED else {"prompt", "request"})
    for prompt, max_tokens, msg in found:
        planes = 1 if layout is KVLayout.SHARED else 4
        kv_blocks = -(-(prompt + max_tokens - 1) // 4) * planes
        if prompt + max_tokens > 40:
            assert "max_position_embeddings (40)" in msg
        elif kv_blocks > 12:
            assert f"needs {kv_blocks} KV blocks but the cache has only 12" in msg
        else:
            assert msg == ""


def test_the_last_sampled_token_needs_no_kv_slot() -> None:
    kv = KVGeometry(block_size=4, num_blocks=2, num_planes=1)
    check_request_fits(5, 4, 100, kv)  # 8 slots: exactly two blocks
    with pytest.raises(RequestError, match="needs 3 KV blocks"):
        check_request_fits(6, 4, 100, kv)
    check_request_fits(6, 4, 100, None)  # cache unknown: positions only
    with pytest.raises(RequestError, match="max_position_embeddings"):
        check_request_fits(60, 41, 100, None)
