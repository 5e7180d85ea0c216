"""Text <-> token ids with a checkpoint's own tokenizer files, as Hugging Face applies them.

One ``TextCodec`` serves admission (online) and the offline CLI, so a text prompt gives the
same ids everywhere. What ``encode`` does matches ``AutoTokenizer.from_pretrained(dir)(text)``
(transformers 5; checked in tests/test_tokenizer.py):

- the pipeline of ``tokenizer.json`` (normalizer, pre-tokenizer, model), and its
  **post-processor** decides which special tokens a text gets (a BOS, an EOS, or nothing).
  ``add_bos_token`` / ``add_eos_token`` in tokenizer_config.json do not override it when a
  tokenizer.json exists (transformers drops them then);
- tokenizer_config.json's named special tokens (``bos_token``, ``eos_token``, ``unk_token``,
  ``pad_token``, ...) become special: never split, and skipped by ``decode``. Tokens of
  ``additional_special_tokens`` / ``extra_special_tokens`` and ``added_tokens_decoder`` are
  added when tokenizer.json lacks them, but keep tokenizer.json's flag when it has them
  (transformers 5 does the same; Ouro's chat tokens are special in its tokenizer.json);
- chat prompts render the checkpoint's chat template (``chat_template.jinja``, else
  tokenizer_config.json's ``chat_template``) in transformers' Jinja environment and are
  tokenized *without* post-processor specials, as ``apply_chat_template(tokenize=True)``.

Known transformers difference: for a few model-specific ``tokenizer_class`` values (e.g.
``GPT2Tokenizer``) transformers 5 rebuilds the pre-tokenizer from the class instead of
reading tokenizer.json; rlt always follows tokenizer.json, the pipeline the checkpoint
ships.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders

from services.common.config_error import ConfigError, load_json_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_NAMED_SPECIALS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
_SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")


class TextCodec:
    """A checkpoint's tokenizer: encode, decode, chat template, special-token facts."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        # name -> content, e.g. {"bos_token": "<|endoftext|>"}; what chat templates see
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self.special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        # byte-level BPE (GPT-2, Qwen, SmolLM, Ouro): the decode of a byte stream, which
        # lets the detokenizer bound its window (see IncrementalDetokenizer)
        self.is_byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        # SentencePiece-style byte fallback (<0xE2> tokens): a run of them decodes as one
        # group, all of it U+FFFD when any byte is invalid, so the run is open until a
        # text token closes it
        self._byte_fallback = _decoder_types(tokenizer) & {"ByteFallback"} != set()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> TextCodec | None:
        """The directory's tokenizer, or None when it has no tokenizer.json (then only token
        ids are accepted). Raises ConfigError for unreadable tokenizer files."""
        ckpt = Path(checkpoint_dir)
        path = ckpt / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises plain Exceptions
            raise ConfigError(f"{path}: cannot be read: {e}") from e
        config = _read_json(ckpt / TOKENIZER_CONFIG_FILE)
        if not config.get("bos_token") and not config.get("eos_token"):
            config = {**_read_json(ckpt / SPECIAL_TOKENS_MAP_FILE), **config}
        specials = _apply_tokenizer_config(tokenizer, config, ckpt / TOKENIZER_CONFIG_FILE)
        template_file = ckpt / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            template: str | None = template_file.read_text(encoding="utf-8")
        else:
            template = _default_template(config.get("chat_template"))
        return cls(tokenizer, specials, template)

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        """``AutoTokenizer(text)["input_ids"]``: with what the post-processor adds."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped (as the streams show it)."""
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        """One token decoded on its own, special tokens included (what log-probabilities
        name a token by; a byte of a longer character decodes to U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The rendered chat prompt (a string), as ``apply_chat_template(tokenize=False)``.
        ``tools`` reach the template as transformers passes a list of JSON schemas (OpenAI's
        ``{"type": "function", "function": {...}}`` entries, unchanged); ``template_kwargs``
        too (e.g. ``enable_thinking=True``)."""
        if self.chat_template is None:
            raise ConfigError("this checkpoint's tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        context = {**self.special_tokens, **template_kwargs}
        return self._template.render(
            messages=[dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a chat prompt: the rendered template, tokenized without the
        post-processor's specials (the template writes its own), as transformers does."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self._tok.encode(text, add_special_tokens=False).ids

    # ------------------------------------------------------------------ facts
    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_token_id(self, name: str) -> int | None:
        """Id of a named special token (``"bos_token"``, ``"eos_token"``, ...), if any."""
        content = self.special_tokens.get(name)
        return None if content is None else self._tok.token_to_id(content)

    def added_by_encode(self) -> list[int]:
        """The ids the post-processor adds to every text (e.g. [BOS]); [] for Ouro."""
        return self._tok.encode("", add_special_tokens=True).ids

    def produces_text(self, token_id: int) -> bool:
        """Whether ``decode`` gives this id any bytes (specials and unknown ids give none)."""
        return token_id not in self.special_ids and self._tok.id_to_token(token_id) is not None

    def is_byte_piece(self, token_id: int) -> bool:
        """A byte-fallback token (``<0xNN>``) of a decoder that groups them."""
        if not self._byte_fallback:
            return False
        token = self._tok.id_to_token(token_id)
        return token is not None and _BYTE_PIECE.fullmatch(token) is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ vocabulary
    def token_pieces(self, size: int) -> list[str]:
        """Ids ``0 .. size-1`` as the vocabulary spells them (byte-level ``Ġthe``, or
        SentencePiece ``▁the``): what a grammar engine matches text against. Special tokens
        and ids the tokenizer lacks are "" (never text: the streams skip specials)."""
        pieces = [""] * size
        for piece, token_id in self._tok.get_vocab(with_added_tokens=True).items():
            if token_id < size and token_id not in self.special_ids:
                pieces[token_id] = piece
        return pieces

    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text, with the special tokens the tokenizer
        config adds (what llguidance reads a vocabulary from)."""
        return self._tok.to_str()

    @property
    def byte_fallback(self) -> bool:
        """SentencePiece-style byte fallback (``<0xE2>`` pieces)."""
        return self._byte_fallback

    @property
    def adds_prefix_space(self) -> bool:
        """Whether encoding a text starts it with a space piece (SentencePiece's ``▁``)."""
        pieces = self._tok.encode("a", add_special_tokens=False).tokens
        return bool(pieces) and pieces[0].startswith(("\u2581", "\u0120"))


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _decoder_types(tokenizer: Tokenizer) -> set[str]:
    """The types of the decoder and, for a Sequence, of its members."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    members = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return {m.get("type", "") for m in members if isinstance(m, dict)}


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when there is no such file."""
    return load_json_file(path, _json_object) if path.is_file() else {}


def _json_object(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError("must be a JSON object")
    return raw


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _apply_tokenizer_config(tokenizer: Tokenizer, config: Mapping[str, Any], path: Path) -> dict:
    """Adds what tokenizer_config.json declares special (transformers does the same when it
    loads a tokenizer); returns the named special tokens (name -> content)."""
    to_add: list[AddedToken] = []
    declared = config.get("added_tokens_decoder") or {}
    for key, entry in declared.items() if isinstance(declared, Mapping) else ():
        content = _token_content(entry)
        if content is None or not isinstance(entry, Mapping):
            raise ConfigError(f"{path}: invalid added_tokens_decoder entry {key!r}")
        to_add.append(
            AddedToken(
                content,
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not entry.get("special", False))),
                special=bool(entry.get("special", False)),
            )
        )
    specials: dict[str, str] = {}
    for name in _NAMED_SPECIALS:
        content = _token_content(config.get(name))
        if content is not None:
            specials[name] = content
    for content in specials.values():
        to_add.append(AddedToken(content, special=True, normalized=False))
    for name in _SPECIAL_LISTS:
        for content in map(_token_content, config.get(name) or ()):
            if content and tokenizer.token_to_id(content) is None:
                to_add.append(AddedToken(content, special=True, normalized=False))
    # tokens already in tokenizer.json keep their ids; only their "special" flag may change
    tokenizer.add_tokens([t for t in to_add if not t.special])
    tokenizer.add_special_tokens([t for t in to_add if t.special])
    for key, entry in declared.items() if isinstance(declared, Mapping) else ():
        got = tokenizer.token_to_id(_token_content(entry) or "")
        if str(got) != str(key):
            raise ConfigError(
                f"{path}: added_tokens_decoder gives {_token_content(entry)!r} id {key}, "
                f"the tokenizer gives it id {got}"
            )
    return specials


def _default_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    raise ConfigError(f"tokenizer_config.json field 'chat_template' is invalid: {value!r:.80}")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens with
    it); here it only renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces Jinja's tojson, which would HTML-escape the JSON
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_template(source: str) -> jinja2.Template:
    """The chat template in the Jinja environment transformers renders it in: sandboxed,
    ``trim_blocks`` and ``lstrip_blocks``, loop controls, and the same extra globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template does not compile: {e}") from e
