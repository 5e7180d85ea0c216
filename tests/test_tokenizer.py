"""TextCodec is AutoTokenizer's default; IncrementalDetokenizer's stream equals decode(ids).

The AutoTokenizer comparisons run when transformers is installed (a dev dependency: the
runtime never needs it) and read only files these tests write (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from services.common.detokenizer import IncrementalDetokenizer
from services.common.tokenizer import TextCodec
from services.worker.model.toy import CHAT_TEMPLATE, train_toy_tokenizer

pytestmark = pytest.mark.unit

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing tabs\t\n",
    "héllo wörld — naïve café ✓ 42",
    "emoji 😀🎉 and CJK 漢字かな",
    "numbers 1234567890 and 3.14159",
    "a chat token inside text: <|im_end|> and <|endoftext|>",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
]


@pytest.fixture(scope="module")
def toy_codec(toy_checkpoint: Path) -> TextCodec:
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    assert codec is not None
    return codec


def auto_tokenizer(path: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def edit_json(path: Path, **fields: Any) -> None:
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))


# ---------------------------------------------------------------------- AutoTokenizer
@needs_transformers
def test_toy_tokenizer_matches_auto_tokenizer(toy_checkpoint: Path, toy_codec: TextCodec) -> None:
    hf = auto_tokenizer(toy_checkpoint)
    for text in TEXTS:
        assert toy_codec.encode(text) == hf(text)["input_ids"], text
    for messages in MESSAGES:
        for gen in (True, False):
            assert toy_codec.apply_chat_template(messages, gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert toy_codec.encode_chat(messages, gen) == list(ids)
    ids = [*range(0, 40), 510, 511, 300, 0, 200]
    assert toy_codec.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@needs_transformers
def test_post_processor_decides_what_a_text_gets(toy_checkpoint: Path, tmp_path: Path) -> None:
    # a tokenizer.json whose post-processor adds a BOS: both add it
    bos = tokenizer_dir(toy_checkpoint, tmp_path / "bos")
    tok = Tokenizer.from_file(str(bos / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>",
        special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 511)],
    )
    tok.save(str(bos / "tokenizer.json"))
    codec = TextCodec.from_checkpoint(bos)
    assert codec is not None and codec.added_by_encode() == [0, 511]
    hf = auto_tokenizer(bos)
    for text in TEXTS:
        assert codec.encode(text) == hf(text)["input_ids"], text
    # add_bos_token in tokenizer_config.json does not override tokenizer.json (transformers
    # drops the flag when a tokenizer.json exists)
    flag = tokenizer_dir(toy_checkpoint, tmp_path / "flag")
    edit_json(flag / "tokenizer_config.json", add_bos_token=True, add_eos_token=True)
    codec = TextCodec.from_checkpoint(flag)
    assert codec is not None and codec.added_by_encode() == []
    assert codec.encode(TEXTS[0]) == auto_tokenizer(flag)(TEXTS[0])["input_ids"]


@needs_transformers
@pytest.mark.parametrize(
    ("fields", "skipped"),
    [
        ({"bos_token": "<|bos|>"}, "<|bos|>"),  # a named special token becomes special
        ({"additional_special_tokens": ["<|tool|>"]}, None),  # keeps tokenizer.json's flag
        ({"added_tokens_decoder": {"514": {"content": "<|x|>", "special": True}}}, "<|x|>"),
    ],
)
def test_config_special_tokens_as_transformers_reads_them(
    toy_checkpoint: Path, tmp_path: Path, fields: dict[str, Any], skipped: str | None
) -> None:
    d = tokenizer_dir(toy_checkpoint, tmp_path / "named")
    tok = train_toy_tokenizer(512)
    # added to tokenizer.json as ids 512-514, not special there
    tok.add_tokens([AddedToken(t, special=False) for t in ("<|tool|>", "<|bos|>", "<|x|>")])
    assert tok.token_to_id("<|x|>") == 514
    tok.save(str(d / "tokenizer.json"))
    edit_json(d / "tokenizer_config.json", **fields)
    codec = TextCodec.from_checkpoint(d)
    hf = auto_tokenizer(d)
    assert codec is not None
    text = "call <|tool|> now <|bos|> and <|x|>"
    ids = codec.encode(text)
    assert ids == hf(text)["input_ids"]
    assert codec.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    expected = text.replace(skipped, "") if skipped else text
    assert codec.decode(ids) == expected


@needs_transformers
def test_chat_template_file_and_jinja_environment(toy_checkpoint: Path, tmp_path: Path) -> None:
    d = tokenizer_dir(toy_checkpoint, tmp_path / "tpl")
    # trim_blocks/lstrip_blocks, loop controls, tojson, raise_exception, namespace,
    # {% generation %} and template kwargs, all as transformers renders them
    template = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|im_start|>{{ m['role'] }} {{ ns.n }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}
{% else %}{{ m['content'] | tojson }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}{{ eos_token }}"""
    (d / "chat_template.jinja").write_text(template)  # wins over tokenizer_config.json's
    codec = TextCodec.from_checkpoint(d)
    hf = auto_tokenizer(d)
    assert codec is not None and codec.chat_template == template != CHAT_TEMPLATE
    for messages in MESSAGES:
        for kwargs in ({}, {"enable_thinking": True}):
            ours = codec.apply_chat_template(messages, True, **kwargs)
            theirs = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
            assert ours == theirs
    with pytest.raises(Exception, match="no tools"):
        codec.apply_chat_template([{"role": "tool", "content": "x"}])


def test_codec_without_a_tokenizer_file(tmp_path: Path) -> None:
    assert TextCodec.from_checkpoint(tmp_path) is None


# ---------------------------------------------------------------------- detokenizer
def stream(codec: TextCodec, ids: list[int]) -> tuple[list[str], str, int]:
    """(deltas, flushed tail, the largest window) of streaming ``ids``."""
    detok = IncrementalDetokenizer(codec)
    deltas, widest = [], 0
    for token in ids:
        deltas.append(detok.push(token))
        widest = max(widest, detok.window_len)
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail, widest


def _byte_ids(codec: TextCodec) -> list[int]:
    """The toy BPE's single-byte tokens: most of them are not valid UTF-8 alone."""
    return [i for i in range(codec.vocab_size) if len(codec.decode([i]).encode()) <= 3][:260]


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_stream_equals_decode_on_any_ids(toy_codec: TextCodec, data: st.DataObject) -> None:
    ids_strategy = st.one_of(
        st.integers(0, toy_codec.vocab_size - 1),  # any id, specials included
        st.sampled_from(_byte_ids(toy_codec)),  # invalid and incomplete UTF-8
    )
    ids = data.draw(st.lists(ids_strategy, max_size=80))
    deltas, tail, widest = stream(toy_codec, ids)
    assert "".join(deltas) + tail == toy_codec.decode(ids)
    assert widest <= 9  # O(window) per token, not O(n)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\ufffd")))
def test_valid_text_streams_whole_characters(toy_codec: TextCodec, text: str) -> None:
    ids = toy_codec.encode(text)
    deltas, tail, _ = stream(toy_codec, ids)
    assert "".join(deltas) + tail == toy_codec.decode(ids)
    # a multi-byte character is never split: no delta shows a replacement character
    assert not any("\ufffd" in d for d in deltas) and tail == ""


def test_invalid_bytes_at_the_end_come_out_at_flush(toy_codec: TextCodec) -> None:
    euro = toy_codec.encode("€")  # three bytes, several byte-level tokens
    assert len(euro) > 1
    deltas, tail, _ = stream(toy_codec, toy_codec.encode("ok ") + euro[:-1])
    assert "".join(deltas) == "ok " and tail == "\ufffd"
    deltas, tail, _ = stream(toy_codec, toy_codec.encode("ok ") + euro)
    assert "".join(deltas) == "ok €" and tail == ""


def llama_style_codec(tmp_path: Path) -> TextCodec:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback, a stripped leading space):
    its decoder is not byte-level and treats the first token of a decode specially."""
    trained = json.loads(train_toy_tokenizer(400).to_str())
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for token in [*byte_tokens, "▁", *(t.replace("Ġ", "▁") for t in trained["model"]["vocab"])]:
        vocab.setdefault(token, len(vocab))
    merges = [
        tuple(m.replace("Ġ", "▁").split(" ")) if isinstance(m, str) else tuple(m)
        for m in trained["model"]["merges"]
    ]
    merges = [(a.replace("Ġ", "▁"), b.replace("Ġ", "▁")) for a, b in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    d = tmp_path / "llama"
    d.mkdir(exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    codec = TextCodec.from_checkpoint(d)
    assert codec is not None and not codec.is_byte_level
    return codec


def test_stream_equals_decode_for_sentencepiece_style(tmp_path: Path) -> None:
    codec = llama_style_codec(tmp_path)
    text = "héllo wörld, the lazy dog 😀 ok"
    ids = codec.encode(text)
    assert any(3 <= i < 259 for i in ids)  # byte-fallback tokens are in play
    deltas, tail, _ = stream(codec, ids)
    assert "".join(deltas) + tail == codec.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(st.one_of(st.integers(0, codec.vocab_size - 1), st.integers(3, 258)), max_size=60)
    )
    def check(ids: list[int]) -> None:
        deltas, tail, _ = stream(codec, ids)
        assert "".join(deltas) + tail == codec.decode(ids)

    check()
