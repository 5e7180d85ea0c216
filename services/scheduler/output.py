"""Text for the stream: one incremental detokenizer per request, the same online and offline.

A ``TokenEvent`` carries the text its token adds; the ``FinishedEvent`` carries the whole
text, which is always exactly the concatenation of the stream's token texts. Text that
ends in an incomplete UTF-8 sequence is held back until a later token completes it; when
the request ends by ``stop`` or ``length``, whatever is still held back (e.g. a trailing
U+FFFD) goes out with the last token. An aborted or failed request ends with the text it
streamed. Log-probabilities name their tokens by each token decoded on its own.
"""

from __future__ import annotations

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from services.common.detokenizer import IncrementalDetokenizer
from services.common.tokenizer import TextCodec


class OutputProcessor:
    """Fills in the text of stream events; without a tokenizer every text stays empty."""

    def __init__(self, codec: TextCodec | None) -> None:
        self.codec = codec
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._pieces: dict[int, str] = {}  # token id -> the token decoded on its own

    def process(self, events: list[StreamEvent]) -> list[StreamEvent]:
        if self.codec is None:
            for event in events:
                if isinstance(event, TokenEvent) and (event.logprobs or event.prompt_logprobs):
                    self._name_tokens(event)
            return events
        last_token: dict[str, TokenEvent] = {}
        for event in events:
            rid = event.request_id
            if isinstance(event, TokenEvent):
                detok = self._detoks.get(rid)
                if detok is None:
                    detok = self._detoks[rid] = IncrementalDetokenizer(self.codec)
                event.text = detok.push(event.token_id)
                last_token[rid] = event
                if event.logprobs is not None or event.prompt_logprobs is not None:
                    self._name_tokens(event)
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

    def _name_tokens(self, event: TokenEvent) -> None:
        """The names of the tokens in the event's log-probabilities, if it has any."""
        entries = event.prompt_logprobs or []
        if event.logprobs is not None:
            entries = [*entries, event.logprobs]
        for entry in entries:
            entry.token = self._piece(entry.token_id)
            for top in entry.top_logprobs:
                top.token = self._piece(top.token_id)

    def _piece(self, token_id: int) -> str:
        """The token decoded on its own; without a tokenizer (or for an id it does not
        know) vLLM's ``token_id:N``, so distinct tokens keep distinct names."""
        piece = self._pieces.get(token_id)
        if piece is not None:
            return piece
        if self.codec is None or not 0 <= token_id < self.codec.vocab_size:
            return f"token_id:{token_id}"
        piece = self._pieces[token_id] = self.codec.piece(token_id)  # at most the vocabulary
        return piece

    def prime(self, request_id: str, token_ids: list[int]) -> None:
        """A resumed request: its detokenizer takes the tokens the client already has (their
        text was streamed elsewhere), so the next deltas and the final text go on from them.
        Incremental detokenization depends only on the token sequence, so this state equals
        the one the first shard had."""
        if self.codec is None:
            return
        detok = self._detoks[request_id] = IncrementalDetokenizer(self.codec)
        for token_id in token_ids:
            detok.push(token_id)

    def forget(self, request_id: str) -> None:
        self._detoks.pop(request_id, None)

    def clear(self) -> None:
        self._detoks.clear()
