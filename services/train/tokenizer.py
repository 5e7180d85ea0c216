"""A byte-level BPE trained on the corpus, with Ouro's special tokens.

``<|endoftext|>`` is id 0 (config.json's EOS, and the separator between documents), the two
ChatML tokens take the last ids, as in the toy tokenizer, so the same chat template and
generation config apply.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

from services.worker.model.toy import CHAT_TOKENS, EOS_TOKEN, train_byte_level_bpe


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = train_byte_level_bpe(texts, vocab_size - len(CHAT_TOKENS))
    tok.add_special_tokens(list(CHAT_TOKENS))
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise RuntimeError("the BPE trainer must give <|endoftext|> id 0")
    return tok
