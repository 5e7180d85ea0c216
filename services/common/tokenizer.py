"""Text <-> token ids with the checkpoint's own ``tokenizer.json`` (HF tokenizers)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextCodec:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> TextCodec | None:
        path = Path(checkpoint_dir) / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path))) if path.exists() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)
