"""Small random Ouro checkpoints in the exact HF on-disk format, for tests, demos and benches.

No weights can be downloaded here, so the loader, worker and engine are exercised on these.
The init is deterministic from a seed and tuned so that outputs are not degenerate and the
exit gate yields a mix of exit depths (see ``write_toy_checkpoint``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.common.model_config import OuroConfig

from .loader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, expected_shapes
from .sizes import CHECKPOINT_SIZES, DEFAULT_DTYPE

EOS_TOKEN = "<|endoftext|>"
# Ouro's chat turns (ChatML); a chat reply ends with IM_END, which generation_config.json
# lists as an end of sequence next to config.json's <|endoftext|>
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)
# Ouro's chat template, in the ChatML form its tokenizer_config.json carries, with tools in
# the Hermes/Qwen form: rlt's default tool prompt (services/common/tool_template.py) written
# by the template itself, so a chat without tools renders exactly as Ouro's does
CHAT_TEMPLATE = """{% if tools %}
{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}
{{ (messages[0]['content'] or '') + '\\n\\n' }}{% endif %}
{{ '# Tools\\n\\nYou may call these functions (JSON signatures, one a line):\\n'
   '<tools>\\n' }}{% for tool in tools %}
{{ (tool | tojson) + '\\n' }}{% endfor %}
{{ '</tools>\\n\\nTo call a function, write a <tool_call></tool_call> block holding a '
   'JSON object with its name and arguments:\\n<tool_call>\\n{"name": <function name>, '
   '"arguments": <arguments as a JSON object>}\\n</tool_call>\\nWrite one block per call.'
   '<|im_end|>\\n' }}{% endif %}
{% for message in messages %}
{% if tools and loop.first and message['role'] == 'system' %}{% continue %}{% endif %}
{% if message['role'] == 'tool' %}
{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user\\n' }}
{%- else %}{{ '\\n' }}{% endif %}
{{ '<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{% elif message['role'] == 'assistant' and message['tool_calls'] %}
{{ '<|im_start|>assistant\\n' }}
{%- if message['content'] %}{{ message['content'] + '\\n' }}{% endif %}
{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}
{{ '<tool_call>\\n'
   + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)
   + '\\n</tool_call>' }}{% endfor %}
{{ '<|im_end|>\\n' }}{% else %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

# shards of a multi-file checkpoint are cut at about this size, as in published checkpoints
SHARD_BYTES = 2 << 30


# Deterministic built-in training text for the toy BPE (plain English, varied vocabulary).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A looped language model runs the same stack of
layers several times for every token, and it may stop early when it is confident enough.
Once upon a time there was a small village by the sea. The fishermen went out every morning
before the sun rose, and the children waited on the shore for the boats to come back home.
In the evening the lights of the harbour were reflected in the calm water, and old sailors
told stories about storms, islands, whales and distant cities beyond the horizon.
Science is the patient work of asking questions and testing answers against the world.
Mathematics gives us a language for patterns: numbers, shapes, functions and proofs.
Computers follow instructions exactly, which is why a single missing character can break a
program. Engineers write tests so that they notice mistakes before their users do.
The weather today is sunny with a light breeze from the west; tomorrow it will rain.
She opened the window, made a cup of tea, and read the letter twice before answering it.
He said that the train would arrive at seven, but it was late because of the snow.
Good morning! How are you? I am fine, thank you. What would you like to eat for lunch?
We planted apples, pears, cherries and plums in the garden, and grew beans and potatoes.
The library was quiet except for the sound of pages turning and the clock on the wall.
Music, painting and poetry help people share feelings that are hard to put into words.
A river flows from the mountains to the ocean, carving valleys through ancient rock.
Every request is scheduled in batches; the server streams tokens back as they are ready.
Birds sing in the trees, cats sleep in the sun, and dogs chase balls across the park.
History teaches us that great change often begins with small and ordinary decisions.
The doctor listened carefully, wrote a short note, and asked the patient to rest.
Please remember to close the door, turn off the lights, and feed the cat before leaving.
Learning a new language takes time, practice, curiosity and a little bit of courage.
The market was full of colours: red tomatoes, yellow lemons, green peppers, purple grapes.
Children asked why the sky is blue, why the moon changes shape, and where the wind goes.
Our team finished the project on Friday and celebrated with pizza, cake and lemonade.
The first chapter introduces the characters; the second describes their long journey north.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in dates, prices and measurements.
Energy from the sun warms the earth, drives the winds, and feeds every growing plant.
"""


def toy_config(size: str = "toy") -> OuroConfig:
    if size not in CHECKPOINT_SIZES:
        raise ValueError(f"unknown toy size {size!r}; choose one of {sorted(CHECKPOINT_SIZES)}")
    s = CHECKPOINT_SIZES[size]
    hidden, heads = int(s["hidden_size"]), int(s["num_attention_heads"])
    return OuroConfig(
        hidden_size=hidden,
        intermediate_size=int(s["intermediate_size"]),
        num_hidden_layers=int(s["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(s["num_key_value_heads"]),
        vocab_size=int(s["vocab_size"]),
        rms_norm_eps=float(s["rms_norm_eps"]),
        rope_theta=float(s["rope_theta"]),
        max_position_embeddings=int(s["max_position_embeddings"]),
        total_ut_steps=int(s["total_ut_steps"]),
        early_exit_threshold=float(s["early_exit_threshold"]),
        tie_word_embeddings=bool(s["tie_word_embeddings"]),
        eos_token_ids=(0,),  # the BPE trainer gives the first special token id 0
        bos_token_id=0,
        head_dim=hidden // heads,
    )


def init_mean_std(name: str, shape: tuple[int, ...], hidden: int) -> tuple[float, float]:
    """(mean, std) of one random weight.

    Sandwich norms renormalise every sublayer output, so projection scale only shapes the
    direction; embeddings are unit-scale so the token identity survives in the residual;
    lm_head and gate are scaled against the unit-RMS normed hidden state so logits have
    std ~2 (distinct argmaxes) and gate logits std ~1 (hazards spread over ~0.15..0.85).
    """
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0, 0.05
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name == "lm_head.weight":
        return 0.0, 2.0 / math.sqrt(hidden)
    if name == "model.early_exit_gate.weight":
        return 0.0, 1.0 / math.sqrt(hidden)
    if name == "model.early_exit_gate.bias":
        return 0.0, 0.1
    # fan-in scaled projections keep pre-norm activations O(1) (no overflow in fp16)
    return 0.0, 1.0 / math.sqrt(shape[1])


def random_weights(
    cfg: OuroConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    trained_vocab: int | None = None,
    gen_device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights one tensor at a time, deterministic from ``seed`` (and the device).

    Drawn in float32 and cast per tensor, so a 1.4B checkpoint never needs a whole-model
    float32 copy. lm_head rows from ``trained_vocab`` on are zero (logit 0): greedy decoding
    never picks the tokenizer's reserved padding ids, like the unused rows of real
    checkpoints.
    """
    g = torch.Generator(device=gen_device).manual_seed(seed)
    for name, shape in expected_shapes(cfg).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        mean, std = init_mean_std(name, shape, cfg.hidden_size)
        t = torch.randn(shape, generator=g, dtype=torch.float32, device=gen_device) * std
        if mean:
            t = t + mean
        if name == "lm_head.weight" and trained_vocab is not None:
            t[trained_vocab:] = 0.0
        yield name, t.to(dtype).cpu().contiguous()


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of at most ``vocab_size`` ids trained on ``texts``, <|endoftext|> id 0;
    as in Ouro's tokenizer, its post-processor adds no special token to an encoded text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_toy_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained in-process on the built-in corpus; EOS is id 0.

    The small corpus cannot fill a large vocab, so the rest is padded with reserved special
    tokens: every id the model can emit then decodes (to "" with skip_special_tokens), as with
    the padded vocabularies of real checkpoints. The chat tokens take the last two ids, so
    the trained ids and the reserved range are those of the tokenizer without them. As in
    Ouro's tokenizer, the post-processor adds no special token to an encoded text.
    """
    tok = train_byte_level_bpe(_CORPUS.splitlines(), vocab_size - len(CHAT_TOKENS))
    trained = tok.get_vocab_size()
    reserved = vocab_size - len(CHAT_TOKENS) - trained
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(reserved)])
    tok.add_special_tokens(list(CHAT_TOKENS))
    return tok


def num_trained_tokens(tok: Tokenizer) -> int:
    """Ids below this are real BPE tokens; the rest are reserved padding."""
    reserved = [i for t, i in tok.get_vocab().items() if t.startswith("<|reserved_")]
    return min(reserved) if reserved else tok.get_vocab_size()


def write_toy_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    size: str = "toy",
    dtype: torch.dtype | None = None,
    gen_device: str | torch.device = "cpu",
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write config.json, weights and tokenizer files into ``out_dir``; return it.

    Weights go to one ``model.safetensors``, or to HF-style shards plus an index once they
    pass ``shard_bytes``. ``dtype`` defaults to the size's (bfloat16 for 1.4b).
    """
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype is None:
        dtype = getattr(torch, DEFAULT_DTYPE[size]) if size in DEFAULT_DTYPE else torch.float32
    if dtype not in dtype_name:
        raise ValueError(f"unsupported toy checkpoint dtype {dtype}")
    cfg = replace(toy_config(size), torch_dtype=dtype_name[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_toy_tokenizer(cfg.vocab_size)
    if tok.get_vocab_size() > cfg.vocab_size or tok.token_to_id(EOS_TOKEN) != cfg.eos_token_ids[0]:
        raise RuntimeError("toy tokenizer does not fit the toy config")  # a bug, not user input
    weights = random_weights(cfg, seed, dtype, num_trained_tokens(tok), gen_device)
    save_weights(weights, out, shard_bytes)
    write_tokenizer_files(out, tok, cfg)
    # config.json last: callers that cache checkpoints treat it as "the write finished"
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return out


def write_tokenizer_files(
    out: Path, tok: Tokenizer, cfg: OuroConfig, chat_template: str = CHAT_TEMPLATE
) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json
    (config.json's EOS and the chat turn's end), as Ouro's checkpoints carry them."""
    tok.save(str(out / "tokenizer.json"))
    im_end = tok.token_to_id(IM_END)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": EOS_TOKEN,
                "unk_token": None,
                "additional_special_tokens": list(CHAT_TOKENS),
                "model_max_length": cfg.max_position_embeddings,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "chat_template": chat_template,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": cfg.bos_token_id,
                "eos_token_id": [cfg.eos_token_ids[0], im_end],
            },
            indent=2,
        )
        + "\n"
    )


def save_weights(weights: Iterator[tuple[str, torch.Tensor]], out: Path, shard_bytes: int) -> None:
    """One safetensors file, or shards named model-0000i-of-0000n with an index.

    Shards are written as they fill, so at most one shard is held in memory; their final
    names need the shard count, so they are renamed once it is known.
    """
    shard_names: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            tmp = out / f"shard-{len(shard_names)}.tmp"
            save_file(current, str(tmp), metadata={"format": "pt"})
            shard_names.append(list(current))
        current, current_bytes = {}, 0

    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if current and current_bytes + nbytes > shard_bytes:
            flush()
        current[name] = t
        current_bytes += nbytes
        total += nbytes
    flush()
    if len(shard_names) == 1:
        (out / "shard-0.tmp").replace(out / SINGLE_FILE)
        return
    files = [
        f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors" for i in range(len(shard_names))
    ]
    weight_map: dict[str, str] = {}
    for i, (file, names) in enumerate(zip(files, shard_names, strict=True)):
        (out / f"shard-{i}.tmp").replace(out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def default_checkpoint_dir(size: str = "toy") -> Path:
    """Where ``ensure_checkpoint`` keeps the generated checkpoint of each size."""
    base = Path(os.environ.get("RLT_CACHE_DIR", Path.home() / ".cache" / "rlt"))
    return base / f"{size}-checkpoint"


def ensure_checkpoint(path: str | Path | None, size: str = "toy") -> Path:
    """The given checkpoint, or a random one of ``size`` written once into the cache dir."""
    if path:
        return Path(path)
    target = default_checkpoint_dir(size)
    if not (target / "config.json").exists():
        write_toy_checkpoint(target, seed=0, size=size)
    return target
