"""A downloaded Ouro checkpoint behaves as in Hugging Face, or is refused with a reason.

Each test writes an HF-format checkpoint variant (the toy's weights, edited config files)
and checks the engine against the serial oracle, which reads the same files with its own
code (HF's defaults, generation_config.json, sliding windows), or checks the named error.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from tokenizers import Tokenizer, processors

from messages.api import FinishedEvent, GenerateRequest
from messages.sampling import SamplingParams
from services.admission.core import AdmissionConfig, AdmissionCore, AdmissionError
from services.common.checkpoint import load_model_limits
from services.common.config import ModelLimits, SchedulerConfig
from services.common.model_config import ConfigError, OuroConfig, config_field_report
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.engine.offline import collect_prompts
from services.oracle import SerialOracle
from services.worker.model.loader import load_checkpoint
from tests.engine_harness import assert_matches_oracle

# a prompt longer than the test window (4) so that a window would change attention
PROMPT = [17, 301, 45, 9, 220, 130, 77, 402, 5, 64, 88, 150]
ENGINE = SchedulerConfig(num_blocks=256, block_size=4, max_num_batched_tokens=64)


def variant(
    src: Path,
    dst: Path,
    config: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    generation: dict[str, Any] | None = None,
) -> Path:
    """A copy of ``src`` with config.json fields set/dropped and, when given, a new
    generation_config.json (an empty dict deletes the file)."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    raw = json.loads(path.read_text())
    raw.update(config or {})
    for name in drop:
        raw.pop(name, None)
    path.write_text(json.dumps(raw))
    if generation is not None:
        gen = dst / "generation_config.json"
        if generation:
            gen.write_text(json.dumps(generation))
        else:
            gen.unlink()
    return dst


def run_engine(ckpt: Path, prompt: list[int], params: SamplingParams) -> FinishedEvent:
    (finished,) = LLMEngine.from_checkpoint(ckpt, ENGINE).generate([prompt], params)
    return finished


def check_against_oracle(ckpt: Path, prompt: list[int], params: SamplingParams) -> FinishedEvent:
    """Engine and oracle on the same files, each resolving unset fields on its own."""
    finished = run_engine(ckpt, prompt, params)
    expected = SerialOracle(ckpt).generate(
        prompt,
        max_tokens=params.max_tokens,
        min_loops=params.min_loops,
        exit_threshold=params.exit_threshold,
        ignore_eos=params.ignore_eos,
    )
    assert assert_matches_oracle(finished, expected) >= 3
    return finished


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def first_new_token(tokens: list[int]) -> tuple[int, int]:
    """(index, token) of the first token after the first two not seen before it: making it an
    eos stops generation exactly there."""
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    return index, tokens[index]


# ---------------------------------------------------------------------- sliding window
@pytest.mark.oracle
def test_window_fields_without_a_window_are_accepted(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = variant(
        toy_checkpoint,
        tmp_path / "c",
        {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0},
    )
    check_against_oracle(ckpt, PROMPT, GREEDY)


@pytest.mark.oracle
def test_window_that_reaches_no_layer_is_accepted(toy_checkpoint: Path, tmp_path: Path) -> None:
    # HF: layers >= max_window_layers slide; the toy has 2 layers, so none does
    ckpt = variant(
        toy_checkpoint,
        tmp_path / "c",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    )
    check_against_oracle(ckpt, PROMPT, GREEDY)


@pytest.mark.oracle
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
            "use_sliding_window",
        ),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            "layer_types",
        ),
    ],
)
def test_sliding_window_is_refused_by_name(
    toy_checkpoint: Path, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    ckpt = variant(toy_checkpoint, tmp_path / "c", fields)
    for load in (load_checkpoint, load_model_limits, OuroConfig.from_checkpoint):
        with pytest.raises(ConfigError, match=named):
            load(ckpt)
    # what the refusal prevents: HF semantics (the oracle) give other tokens with the window
    windowed = SerialOracle(ckpt).generate(PROMPT, max_tokens=8, ignore_eos=True)
    plain = SerialOracle(toy_checkpoint).generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert windowed.token_ids != plain.token_ids


# ---------------------------------------------------------------------- HF defaults
@pytest.mark.oracle
def test_missing_rope_theta_takes_hf_default(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = variant(toy_checkpoint, tmp_path / "c", drop=("rope_theta",))
    assert OuroConfig.from_checkpoint(ckpt).rope_theta == 10000.0
    check_against_oracle(ckpt, PROMPT, GREEDY)
    # the default matters: the toy's own 1e6 gives other logits
    ours = SerialOracle(ckpt).prompt_logits(PROMPT)
    toy = SerialOracle(toy_checkpoint).prompt_logits(PROMPT)
    assert (ours - toy).abs().max() > 1e-3


@pytest.mark.unit
def test_other_absent_fields_take_hf_defaults(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = variant(
        toy_checkpoint,
        tmp_path / "c",
        drop=("max_position_embeddings", "rms_norm_eps", "total_ut_steps", "early_exit_threshold"),
    )
    cfg = OuroConfig.from_checkpoint(ckpt)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.total_ut_steps) == (32768, 1e-6, 4)
    assert cfg.early_exit_threshold == 1.0
    # num_key_value_heads: absent is HF's 32, which this 4-head toy cannot take (HF's own
    # loading fails too): refused by name; null means one kv head per attention head
    raw = json.loads((toy_checkpoint / "config.json").read_text())
    del raw["num_key_value_heads"]
    with pytest.raises(ConfigError, match=r"no 'num_key_value_heads'.*32"):
        OuroConfig.from_dict(raw)
    assert OuroConfig.from_dict({**raw, "num_key_value_heads": None}).num_key_value_heads == 4
    assert (
        OuroConfig.from_dict({**raw, "num_attention_heads": 32, "head_dim": 16}).num_key_value_heads
        == 32
    )


@pytest.mark.oracle
def test_config_without_eos_ends_only_at_max_tokens(toy_checkpoint: Path, tmp_path: Path) -> None:
    # a token the greedy continuation reaches, made the only eos of one variant
    plain = SerialOracle(toy_checkpoint).generate(PROMPT, max_tokens=8, ignore_eos=True)
    _, stop = first_new_token(plain.token_ids)
    with_eos = variant(toy_checkpoint, tmp_path / "eos", {"eos_token_id": stop}, generation={})
    finished = check_against_oracle(with_eos, PROMPT, SamplingParams(max_tokens=8, temperature=0))
    assert finished.finish_reason == "stop" and finished.token_ids[-1] == stop

    none = variant(toy_checkpoint, tmp_path / "none", drop=("eos_token_id",), generation={})
    with structlog.testing.capture_logs() as logs:
        limits = load_model_limits(none)
    assert limits.eos_token_ids == ()
    assert sum("no eos_token_id" in e["event"] for e in logs) == 1
    finished = check_against_oracle(none, PROMPT, SamplingParams(max_tokens=8, temperature=0))
    assert finished.finish_reason == "length" and stop in finished.token_ids


# ---------------------------------------------------------------------- exit threshold
@pytest.mark.oracle
def test_config_threshold_is_the_default_of_requests(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = variant(toy_checkpoint, tmp_path / "c", {"early_exit_threshold": 0.6})
    unset = SamplingParams(max_tokens=10, temperature=0.0, min_loops=1, ignore_eos=True)
    finished = check_against_oracle(ckpt, PROMPT, unset)
    assert min(finished.exit_depths) < 4  # the 0.6 threshold really exits early
    # a request's own threshold wins, 1.0 included (the API tells unset from 1.0)
    full = run_engine(ckpt, PROMPT, SamplingParams(**{**_fields(unset), "exit_threshold": 1.0}))
    assert set(full.exit_depths) == {4}
    # online: admission resolves the same default before the scheduler sees the request
    core = AdmissionCore(load_model_limits(ckpt), TextCodec.from_checkpoint(ckpt))
    prepared = core.prepare(b'{"prompt_token_ids": [1, 2, 3]}')
    assert prepared.params.exit_threshold == 0.6
    assert prepared.params.max_tokens == 16 and prepared.params.temperature == 1.0


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


# ---------------------------------------------------------------------- generation config
@pytest.mark.oracle
def test_generation_config_eos_list_ends_generation(toy_checkpoint: Path, tmp_path: Path) -> None:
    plain = SerialOracle(toy_checkpoint).generate(PROMPT, max_tokens=8, ignore_eos=True)
    index, stop = first_new_token(plain.token_ids)
    ckpt = variant(toy_checkpoint, tmp_path / "c", generation={"eos_token_id": [0, stop]})
    cfg = OuroConfig.from_checkpoint(ckpt)
    assert cfg.eos_token_ids == (0,) and cfg.stop_token_ids == (0, stop)
    finished = check_against_oracle(ckpt, PROMPT, SamplingParams(max_tokens=8, temperature=0))
    assert finished.finish_reason == "stop" and finished.token_ids == plain.token_ids[: index + 1]
    # ignore_eos covers the generation config's ids too
    ignored = run_engine(ckpt, PROMPT, GREEDY)
    assert ignored.token_ids == plain.token_ids


@pytest.mark.oracle
def test_generation_config_sampling_defaults(toy_checkpoint: Path, tmp_path: Path) -> None:
    generation = {
        "eos_token_id": 0,
        "temperature": 0.0,
        "top_k": 5,
        "top_p": 0.9,
        "max_new_tokens": 3,
        "repetition_penalty": 1.3,
        "do_sample": True,
    }
    ckpt = variant(toy_checkpoint, tmp_path / "c", generation=generation)
    with structlog.testing.capture_logs() as logs:
        limits = load_model_limits(ckpt)
    d = limits.defaults
    assert (d.max_tokens, d.temperature, d.top_k, d.top_p) == (3, 0.0, 5, 0.9)
    assert any("repetition_penalty=1.3" in str(e.get("keys")) for e in logs)
    resolved = limits.resolve(SamplingParams())
    assert (resolved.max_tokens, resolved.temperature, resolved.top_k, resolved.top_p) == (
        3,
        0.0,
        5,
        0.9,
    )
    # a request's own values always win
    own = limits.resolve(SamplingParams(max_tokens=5, temperature=0.5, top_k=0, top_p=1.0))
    assert (own.max_tokens, own.temperature, own.top_k, own.top_p) == (5, 0.5, 0, 1.0)
    # the engine applies them to a request that sets nothing (greedy, 3 tokens)
    finished = check_against_oracle(ckpt, PROMPT, SamplingParams(ignore_eos=True))
    assert len(finished.token_ids) == 3 and finished.finish_reason == "length"


@pytest.mark.unit
def test_generation_keys_in_config_json_without_generation_config(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    # HF builds the generation config from config.json when generation_config.json is absent
    ckpt = variant(toy_checkpoint, tmp_path / "c", {"max_new_tokens": 4}, generation={})
    assert load_model_limits(ckpt).defaults.max_tokens == 4
    report = config_field_report(json.loads((ckpt / "config.json").read_text()))
    assert report["max_new_tokens"].startswith("generation default")


@pytest.mark.unit
def test_invalid_generation_config_is_refused_by_name(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = variant(toy_checkpoint, tmp_path / "c", generation={"eos_token_id": [0, 99999]})
    with pytest.raises(ConfigError, match="99999"):
        load_model_limits(ckpt)
    ckpt = variant(toy_checkpoint, tmp_path / "d", generation={"top_p": 1.5})
    with pytest.raises(ConfigError, match=r"generation_config\.json.*top_p"):
        load_model_limits(ckpt)


# ---------------------------------------------------------------------- refusals
@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"early_exit_step": 1}, "early_exit_step"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"model_type": "qwen2"}, "model_type"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e4}}, "rope_parameters"),
    ],
)
def test_unsupported_fields_are_refused_by_name(
    toy_checkpoint: Path, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    ckpt = variant(toy_checkpoint, tmp_path / "c", fields)
    with pytest.raises(ConfigError, match=named):
        load_checkpoint(ckpt)


@pytest.mark.unit
def test_neutral_and_unknown_fields_are_accepted(toy_checkpoint: Path, tmp_path: Path) -> None:
    fields = {
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "early_exit_step": None,
        "early_exit_threshold": None,
        "chunk_size": 2,
        "some_future_field": 1,
    }
    ckpt = variant(toy_checkpoint, tmp_path / "c", fields)
    cfg, _ = load_checkpoint(ckpt)
    assert cfg.rope_theta == 1e6 and cfg.early_exit_threshold == 1.0
    report = config_field_report(json.loads((ckpt / "config.json").read_text()))
    assert report["some_future_field"].startswith("unknown")
    assert report["chunk_size"].startswith("no effect")
    assert report["rope_theta"] == "implemented"


# ---------------------------------------------------------------------- tokenization
def _bos_adding(src: Path, dst: Path) -> Path:
    ckpt = variant(src, dst)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.save(str(ckpt / "tokenizer.json"))
    return ckpt


@pytest.mark.oracle
def test_bos_adding_tokenizer_online_and_offline(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _bos_adding(toy_checkpoint, tmp_path / "c")
    text = "The quick brown fox"
    codec = TextCodec.from_checkpoint(ckpt)
    assert codec is not None
    plain = TextCodec.from_checkpoint(toy_checkpoint)
    assert plain is not None and plain.added_by_encode() == []  # Ouro's: nothing added
    assert codec.encode(text) == [0, *plain.encode(text)]
    # chat prompts carry their own specials: the post-processor adds nothing to them
    chat = [{"role": "user", "content": text}]
    assert codec.encode_chat(chat) == plain.encode_chat(chat)

    # online (admission) and offline (the CLI's prompt collection) give the same ids
    core = AdmissionCore(load_model_limits(ckpt), codec, AdmissionConfig())
    online = core.prepare(json.dumps({"prompt": text}).encode()).prompt_token_ids
    args = argparse.Namespace(text=[], prompt=[text], prompt_ids=[])
    (offline,) = collect_prompts(args, codec)
    assert online == offline == codec.encode(text)
    check_against_oracle(ckpt, online, GREEDY)


@pytest.mark.unit
def test_chat_messages_use_the_checkpoint_template(toy_checkpoint: Path) -> None:
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    assert codec is not None
    core = AdmissionCore(load_model_limits(toy_checkpoint), codec, AdmissionConfig())
    messages = [{"role": "user", "content": "Hello there"}]
    body = GenerateRequest(messages=messages, max_tokens=4)
    prepared = core.prepare(msgspec.json.encode(body))
    im_start, im_end = codec.token_to_id("<|im_start|>"), codec.token_to_id("<|im_end|>")
    ids = prepared.prompt_token_ids
    assert ids[0] == im_start and im_end in ids and ids.count(im_start) == 2
    assert codec.decode(ids) == "user\nHello there\nassistant\n"  # specials skipped
    assert ids == codec.encode_chat(messages)


@pytest.mark.unit
def test_bad_chat_requests_get_error_replies(toy_checkpoint: Path, tmp_path: Path) -> None:
    def prepare(ckpt: Path, body: dict[str, Any]) -> str:
        core = AdmissionCore(load_model_limits(ckpt), TextCodec.from_checkpoint(ckpt))
        with pytest.raises(AdmissionError) as info:
            core.prepare(json.dumps(body).encode())
        return info.value.message

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert "exactly one of" in prepare(toy_checkpoint, {**chat, "prompt": "hi"})
    assert "'role'" in prepare(toy_checkpoint, {"messages": [{"content": "hi"}]})
    no_template = variant(toy_checkpoint, tmp_path / "plain")
    edit = json.loads((no_template / "tokenizer_config.json").read_text())
    del edit["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(edit))
    assert "no chat template" in prepare(no_template, chat)
    raising = variant(toy_checkpoint, tmp_path / "raising")
    (raising / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0]['content'] }}{{ 1 // (messages|length - 1) }}"
    )
    two = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    assert "one message only" in prepare(raising, two)
    assert "ZeroDivisionError" in prepare(raising, chat)


@pytest.mark.unit
def test_toy_checkpoint_ends_chat_replies_like_ouro(toy_checkpoint: Path) -> None:
    limits: ModelLimits = load_model_limits(toy_checkpoint)
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    assert codec is not None
    assert limits.eos_token_ids == (0, codec.token_to_id("<|im_end|>"))
    assert codec.special_token_id("eos_token") == 0 and codec.added_by_encode() == []


# ---------------------------------------------------------------------- check-checkpoint
def _check(ckpt: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "check-checkpoint", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.services
def test_check_checkpoint_command(toy_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = variant(
        toy_checkpoint, tmp_path / "ok", {"early_exit_threshold": 0.6}, drop=("rope_theta",)
    )
    out = _check(ckpt)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"rope_theta\s+10000\.0\s+\(HF default\)", out.stdout)
    assert "exit_threshold=0.6" in out.stdout
    assert "end of sequence: [0, 511]" in out.stdout
    assert "one token:" in out.stdout and out.stdout.rstrip().endswith("ok")

    bad = variant(
        toy_checkpoint,
        tmp_path / "bad",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
    )
    out = _check(bad)
    assert out.returncode == 1
    assert "refused:" in out.stdout and "use_sliding_window" in out.stdout
