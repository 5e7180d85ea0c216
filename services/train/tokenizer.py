"""A byte-level BPE trained on the corpus, with Ouro's special tokens.

``<|endoftext|>`` is id 0 (config.json's EOS, and the separator between documents), the two
ChatML tokens take the last ids, as in the toy tokenizer, so the same chat template and
generation config apply.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.worker.model.toy import CHAT_TOKENS, EOS_TOKEN


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS),
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(CHAT_TOKENS))
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise RuntimeError("the BPE trainer must give <|endoftext|> id 0")
    return tok
