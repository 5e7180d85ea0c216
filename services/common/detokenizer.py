"""Streaming token ids -> text: the one incremental detokenizer (online streams and offline).

Invariant: ``"".join(d.push(t) for t in ids) + d.flush() == codec.decode(ids)``, always,
including ids whose bytes are not valid UTF-8. A multi-byte character is never split
across deltas: text ending in U+FFFD (an incomplete character, or invalid bytes) is held
back until a later token shows what it is, or until ``flush`` at the end of the request.

How: the detokenizer keeps a short window of ids starting at an anchor token and the
number of characters of ``decode(window)`` already emitted. Each push decodes the window
once (cost proportional to the window, not to the request), emits what is new up to any
trailing U+FFFD run, and, when nothing is held back, moves the anchor to the last token
that produces text. That token stays as left context, so decoders that treat the first
token of a decode specially (SentencePiece's leading-space strip) only affect characters
already emitted. While text is held back the window grows; for byte-level BPE (Ouro's
tokenizer) a long hold is cut at a token boundary where decoding the two halves separately
gives the same text, which for UTF-8 means the byte decoder is back in sync there, so the
window stays bounded even for runs of invalid bytes. SentencePiece byte-fallback tokens
decode as a group (all U+FFFD if any byte is invalid, even bytes that alone were valid),
so a trailing run of them is held back whole until a text token closes it.
"""

from __future__ import annotations

from services.common.tokenizer import TextCodec

_REPLACEMENT = "\ufffd"
# a held-back window longer than this is cut (byte-level tokenizers)
_MAX_HOLD_WINDOW = 8
# boundaries tried per cut, nearest the end first
_CUT_CANDIDATES = 4


class IncrementalDetokenizer:
    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._window: list[int] = []
        self._emitted_in_window = 0  # characters of decode(window) already emitted
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def window_len(self) -> int:
        """Ids kept for the next decode: the cost of a push (bounded for byte-level BPE)."""
        return len(self._window)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ("" while held back)."""
        window = self._window
        window.append(token_id)
        decoded = self._codec.decode(window)
        group = self._open_byte_group()
        if group is not None:
            # text before an open byte-fallback group is final; the group is not
            stable = len(self._codec.decode(window[:group]))
            delta = decoded[self._emitted_in_window : stable]
            self._emitted_in_window = max(self._emitted_in_window, stable)
        elif decoded.endswith(_REPLACEMENT):
            stable = len(decoded.rstrip(_REPLACEMENT))
            delta = decoded[self._emitted_in_window : stable]
            self._emitted_in_window = max(self._emitted_in_window, stable)
            if len(window) > _MAX_HOLD_WINDOW and self._codec.is_byte_level:
                delta += self._cut(decoded)
        else:
            delta = decoded[self._emitted_in_window :]
            self._reanchor()
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """The end of the request: returns whatever is still held back (e.g. a trailing
        U+FFFD of an incomplete character) and resets."""
        delta = self._codec.decode(self._window)[self._emitted_in_window :]
        self._window = []
        self._emitted_in_window = 0
        if delta:
            self._parts.append(delta)
        return delta

    def _open_byte_group(self) -> int | None:
        """Where the window's trailing run of byte-fallback tokens starts (tokens without
        text inside it do not close it), or None when the window does not end in one."""
        start = None
        for i in range(len(self._window) - 1, -1, -1):
            token = self._window[i]
            if self._codec.is_byte_piece(token):
                start = i
            elif self._codec.produces_text(token):
                break
        return start

    def _reanchor(self) -> None:
        """Everything is emitted: keep only the last text-producing token as context."""
        window = self._window
        last = next(
            (i for i in range(len(window) - 1, -1, -1) if self._codec.produces_text(window[i])),
            None,
        )
        if last is None:  # nothing has produced text yet: nothing to keep
            self._window = []
            self._emitted_in_window = 0
            return
        self._window = [window[last]]
        self._emitted_in_window = len(self._codec.decode(self._window))

    def _cut(self, decoded: str) -> str:
        """Moves the anchor to a boundary where the byte decoder is in sync; returns the
        text before it that was still held back (it is final there)."""
        window = self._window
        for cut in range(len(window) - 1, max(0, len(window) - 1 - _CUT_CANDIDATES), -1):
            head = self._codec.decode(window[:cut])
            tail = self._codec.decode(window[cut:])
            if tail and head + tail == decoded:
                delta = decoded[self._emitted_in_window : len(head)]
                self._window = window[cut:]
                self._emitted_in_window = max(0, self._emitted_in_window - len(head))
                return delta
        return ""
