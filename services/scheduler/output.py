"""Text for the stream: one incremental detokenizer per request, the same online and offline.

A ``TokenEvent`` carries the text its token adds; the ``FinishedEvent`` carries the whole
text, which is always exactly the concatenation of the stream's token texts. Text that
ends in an incomplete UTF-8 sequence is held back until a later token completes it; when
the request ends by ``stop`` or ``length``, whatever is still held back (e.g. a trailing
U+FFFD) goes out with the last token. An aborted or failed request ends with the text it
streamed.
"""

from __future__ import annotations

from collections.abc import Callable

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding everything.

    Decodes a short window ``[prefix_offset:]`` and emits what it adds over
    ``[prefix_offset:read_offset]``; holds text back while it ends in an incomplete UTF-8
    sequence (U+FFFD), so multi-byte characters split over tokens arrive whole.
    """

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything emitted so far

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return self._emit(full[len(prefix) :])
        return ""

    def flush(self) -> str:
        """What is still held back, at the end of the request."""
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._emit(full[len(prefix) :])

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta


class OutputProcessor:
    """Fills in the text of stream events; without a tokenizer every text stays empty."""

    def __init__(self, decode: Decode | None) -> None:
        self.decode = decode
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def process(self, events: list[StreamEvent]) -> list[StreamEvent]:
        if self.decode is None:
            return events
        last_token: dict[str, TokenEvent] = {}
        for event in events:
            rid = event.request_id
            if isinstance(event, TokenEvent):
                detok = self._detoks.get(rid)
                if detok is None:
                    detok = self._detoks[rid] = IncrementalDetokenizer(self.decode)
                event.text = detok.push(event.token_id)
                last_token[rid] = event
            elif isinstance(event, FinishedEvent):
                detok = self._detoks.pop(rid, None)
                if detok is None:
                    continue
                final = last_token.get(rid)
                if final is not None and event.finish_reason in ("stop", "length"):
                    final.text += detok.flush()
                event.text = detok.text
            elif isinstance(event, ErrorEvent):
                self._detoks.pop(rid, None)
        return events

    def forget(self, request_id: str) -> None:
        self._detoks.pop(request_id, None)

    def clear(self) -> None:
        self._detoks.clear()
