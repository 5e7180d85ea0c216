"""The shipped trained checkpoint: its format, Hugging Face's structure gives rlt's greedy
tokens on it, and the engine equals the serial oracle on it with early exits (the exits
of a trained gate, where the random toy's are noise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.oracle import SerialOracle
from services.train.export import TRAINING_FILE
from services.worker.model.ouro import OuroModel
from tests.engine_harness import assert_matches_oracle, oracle_result
from tests.hf_ouro import HostedOuro

pytestmark = pytest.mark.oracle

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "looped-stdlib"
PROMPTS = [
    "def read_config(path):\n    ",
    "import os\nimport sys\n\n\nclass ",
    '{"name":"',
    "<|im_start|>user\nWhat does the function getcwd do?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_BYTES = 16 * 2**20


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    codec = TextCodec.from_checkpoint(CHECKPOINT)
    assert codec is not None
    return codec


@pytest.fixture(scope="module")
def model() -> OuroModel:
    return OuroModel.from_checkpoint(CHECKPOINT)


def test_checkpoint_is_small_and_says_how_it_was_trained() -> None:
    size = sum(p.stat().st_size for p in CHECKPOINT.iterdir() if p.is_file())
    assert size <= MAX_BYTES
    training = json.loads((CHECKPOINT / TRAINING_FILE).read_text())
    assert training["minutes"] <= 90
    held = training["log"][-1]["held_out_loss_per_loop"]
    # uniform over the vocabulary would be ln(4096) = 8.3 nats
    assert len(held) == 4 and max(held) < 5.0


def test_hf_structured_ouro_gives_rlts_greedy_tokens(codec: TextCodec, model: OuroModel) -> None:
    host = HostedOuro(CHECKPOINT)
    prompts = [codec.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    finished = LLMEngine(model, SchedulerConfig(max_num_seqs=4)).generate(prompts, params)
    for prompt, out in zip(prompts, finished, strict=True):
        _, tokens = host.greedy(prompt, 12)
        assert out.token_ids == tokens, codec.decode(prompt)


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_engine_equals_oracle_with_the_trained_gates_exits(
    codec: TextCodec, model: OuroModel, threshold: float
) -> None:
    prompts = [codec.encode(p) for p in PROMPTS]
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, min_loops=1, exit_threshold=threshold
    )
    config = SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8, max_num_batched_tokens=24)
    finished = LLMEngine(model, config).generate(prompts, [params] * len(prompts))
    oracle = SerialOracle(CHECKPOINT)
    compared, depths = 0, set()
    for prompt, out in zip(prompts, finished, strict=True):
        compared += assert_matches_oracle(out, oracle_result(oracle, prompt, params, config))
        depths.update(out.exit_depths[1:])
    assert compared >= len(prompts) * 12
    assert len(depths) >= 2, depths  # the trained gate exits at more than one depth
