"""Token-sparse prefill over NATS: ``token_sparse_prefill`` and ``prefill_retention`` travel
through admission to the scheduler and worker services, every finished event equals the
serial oracle's and reports the prompt rows computed, and a bad retention is refused by
admission with a reason. Over HTTP the fields are honoured (``usage.prefill_rows``) and
what cannot run is a 400 that says why."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest
from services.common.config import SchedulerConfig
from services.launcher import NatsServer
from services.oracle import SerialOracle, SparseSetting

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402
from tests.engine_harness import assert_matches_oracle  # noqa: E402
from tests.gateway_helpers import gateway_up  # noqa: E402
from tests.service_procs import wait_for  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]
pytestmark = [pytest.mark.services, pytest.mark.usefixtures("torch_single_thread")]

WINDOW = 16
RETENTIONS = [None, [1.0, 1.0, 0.5, 0.2], None]


async def test_sparse_requests_over_nats_match_the_oracle(
    nats_server: NatsServer, toy_checkpoint: Path, oracle: SerialOracle, run_dir: Path
) -> None:
    config = SchedulerConfig(
        block_size=4,
        num_blocks=512,
        prefill_chunk_size=8,
        max_num_batched_tokens=12,
        sparse_window=WINDOW,
        enable_prefix_caching=True,
    )
    prompts = [[(13 * i + 7 * k) % 400 + 1 for i in range(n)] for k, n in enumerate((40, 29, 40))]
    requests = [
        GenerateRequest(
            request_id=f"sparse-{k}",
            prompt_token_ids=prompt,
            max_tokens=6,
            temperature=0.0,
            ignore_eos=True,
            exit_threshold=0.7,
            token_sparse_prefill=k != 2,  # the last one dense, beside them
            prefill_retention=RETENTIONS[k],
        )
        for k, prompt in enumerate(prompts)
    ]
    bad = GenerateRequest(
        request_id="bad", prompt_token_ids=[1, 2, 3], prefill_retention=[1.0, 0.5]
    )
    async with (
        services_up(nats_server.url, toy_checkpoint, config) as _,
        Client.connect(nats_server.url) as client,
    ):
        streams = await asyncio.gather(*(client.generate(r, timeout=60.0) for r in requests))
        refused = await client.generate(bad, timeout=30.0)
    assert isinstance(refused[-1], ErrorEvent) and "prefill_retention" in refused[-1].message
    for req, events in zip(requests, streams, strict=True):
        finished = check_stream(events)
        assert isinstance(finished, FinishedEvent), finished
        n = len(req.prompt_token_ids or [])
        if req.token_sparse_prefill:
            retention = tuple(req.prefill_retention or (1.0, 1.0, 0.25, 0.1))
            setting = SparseSetting(WINDOW, retention)
            windows = [min(WINDOW, n - s) for s in range(0, n, WINDOW)]
            rows = sum(
                2 * w
                + math.ceil(w * retention[2])
                + min(math.ceil(w * retention[3]), math.ceil(w * retention[2]))
                for w in windows
            )
            assert finished.prefill_rows == rows
        else:
            setting = None
            assert finished.prefill_rows == 4 * n
        expected = oracle.generate(
            req.prompt_token_ids or [],
            max_tokens=6,
            exit_threshold=0.7,
            ignore_eos=True,
            sparse_prefill=setting,
        )
        assert assert_matches_oracle(finished, expected, label=req.request_id or "") == 6


async def test_over_http_sparse_fields_work_and_what_cannot_run_is_a_400(
    nats_server: NatsServer, toy_checkpoint: Path
) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=256, sparse_window=WINDOW)
    prompt = [(11 * i) % 400 + 1 for i in range(24)]
    base = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    async with (
        services_up(nats_server.url, toy_checkpoint, config) as _,
        gateway_up(nats_server.url, toy_checkpoint) as http,
    ):

        async def ready() -> bool:
            return (await http.get("/health")).status_code == 200

        await wait_for(ready, 10, "/health ready")
        ok = await http.post("/v1/completions", json={**base, "token_sparse_prefill": True})
        assert ok.status_code == 200, ok.text
        # 2 dense loops of 24 tokens, then ceil(16/4) + ceil(8/4), ceil(16/10) + ceil(8/10)
        assert ok.json()["usage"]["prefill_rows"] == 48 + 6 + 3
        refused = {
            "prompt_logprobs": {"token_sparse_prefill": True, "prompt_logprobs": 1},
            "echo": {"prefill_retention": [1, 1, 0.5, 0.1], "echo": True, "logprobs": 1},
            "3 entries": {"prefill_retention": [1, 1, 0.5]},
            "(0, 1]": {"prefill_retention": [1, 1, 2, 0.1]},
        }
        for words, fields in refused.items():
            r = await http.post("/v1/completions", json={**base, **fields})
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
            assert words in err["message"], err
