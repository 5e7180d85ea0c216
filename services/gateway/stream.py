"""One request's answer, built from the NATS stream events. Pure: no HTTP, no NATS.

``Answer.on_event`` takes the events of ``rlt.v1.generate``'s stream in order and returns
the ``Delta``s to show (text after string stops, the tokens that made it, a finish
reason). It counts usage as it goes. When a stop string matches, ``needs_abort`` turns
true: the engine does not know about the string, so the shell aborts the request, and the
answer ends there with ``finish_reason: stop`` whatever the engine's own ending says.

``SseEncoder`` frames one choice's deltas as OpenAI's server-sent events for the
completions and the chat endpoint; ``answers_body`` is the response of several choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent, TokenLogprobs
from services.gateway.constrained.tool_parser import ToolCallDelta, ToolCallParser
from services.gateway.errors import error_body
from services.gateway.responses import (
    Usage,
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    response_body,
    vllm_prompt_logprobs,
)
from services.gateway.stops import StopMatcher
from services.gateway.translate import Options

DONE_FRAME = b"data: [DONE]\n\n"
_JSON = msgspec.json.Encoder()


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    exit_depths: list[int]
    finish_reason: str | None = None
    # with logprobs: each token's, and its text offset (``completion_logprobs``)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # vLLM's prompt_logprobs, with the first token's delta when asked for
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # pieces of tool calls the text made (chat with tools: the text is then the content)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Answer:
    request_id: str
    options: Options
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: ErrorEvent | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_shed_tokens: int = 0
    num_prefill_rows: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    engine_done: bool = False  # the engine's terminal event arrived
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked
    _stops: StopMatcher = field(init=False)
    # reads tool calls out of the text, when the output is held to their format
    _tools: ToolCallParser | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._stops = StopMatcher(self.options.stops, self.options.include_stop_str)
        tools = self.options.tools
        if tools is not None and tools.constraint is not None and tools.format is not None:
            self._tools = ToolCallParser(tools.format, self.request_id)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [c.body() for c in self._tools.calls] if self._tools is not None else []

    @property
    def needs_abort(self) -> bool:
        """A stop string ended the answer while the engine is still generating."""
        return self._stops.matched is not None and not self.engine_done

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def usage(self) -> Usage:
        return combined_usage([self])

    def on_event(self, event: StreamEvent) -> list[Delta]:
        if isinstance(event, TokenEvent):
            return self._on_token(event)
        self.engine_done = True
        if isinstance(event, FinishedEvent):
            self.num_prompt_tokens = event.num_prompt_tokens
            self.num_cached_tokens = event.num_cached_tokens
            self.num_shed_tokens = event.shed_tokens
            self.num_prefill_rows = event.prefill_rows
            self.num_draft_tokens = event.draft_tokens
            self.num_accepted_draft_tokens = event.accepted_draft_tokens
            if self.finish_reason is not None:  # a stop string ended it already
                return []
            delta = Delta("", [], [])
            self._show(self._stops.flush(), delta, last=True)
            self.finish_reason = delta.finish_reason = self._finish_reason(event.finish_reason)
            return [delta]
        if self.finish_reason is None:  # after a stop string matched, an engine error is moot
            self.error = event  # type: ignore[assignment]
        return []

    def _on_token(self, event: TokenEvent) -> list[Delta]:
        if self.finish_reason is not None or self.error is not None:
            return []  # the engine ran on after a stop string matched: not shown
        first = not self.token_ids
        if event.num_prompt_tokens is not None:  # the first token's: usage before the end
            self.num_prompt_tokens = event.num_prompt_tokens
            self.num_cached_tokens = event.num_cached_tokens or 0
        self.token_ids.append(event.token_id)
        self.exit_depths.append(event.exit_depth)
        delta = Delta("", [event.token_id], [event.exit_depth])
        echoed = self._on_prompt(event, delta) if first else ""
        if self.options.logprobs is not None:
            # a shard that computes none (an older worker): the token is still listed, its
            # log-probability unknown (null), so the lists cover every token counted
            entry = event.logprobs or TokenLogprobs(
                token_id=event.token_id, logprob=None, token=event.text
            )
            self._add_logprobs(entry, delta)
        stopped = echoed + self._stops.push(event.text)  # stops never match the prompt
        ended = self._stops.matched is not None
        self._show(stopped, delta, last=ended)
        if ended:
            self.finish_reason = delta.finish_reason = self._finish_reason("stop")
        return [delta]

    def _show(self, text: str, delta: Delta, last: bool) -> None:
        """``text`` into ``delta``: as it is, or read as content and tool calls."""
        if self._tools is not None:
            text, delta.tool_calls = self._tools.push(text)
            if last:
                text += self._tools.flush()
        delta.text = text
        self.text += text

    def _finish_reason(self, engine_reason: str) -> str:
        """OpenAI's ``tool_calls`` for an answer that ended after whole calls."""
        if engine_reason == "stop" and self._tools is not None and self._tools.completed:
            return "tool_calls"
        return engine_reason

    def _on_prompt(self, event: TokenEvent, delta: Delta) -> str:
        """The first token's event brings the prompt's log-probabilities and text (when the
        request asked): vLLM's ``prompt_logprobs``, and an echo's text and entries; returns
        the text to echo."""
        entries = event.prompt_logprobs or []
        opts = self.options
        if opts.prompt_logprobs is not None:
            trimmed = [_top_only(e, opts.prompt_logprobs) for e in entries]
            self.prompt_logprobs = delta.prompt_logprobs = vllm_prompt_logprobs(trimmed)
        if opts.echo_text is None:
            return ""
        if opts.logprobs is not None:
            for entry in entries:
                self._add_logprobs(_top_only(entry, opts.logprobs), delta)
        return opts.echo_text

    def _add_logprobs(self, entry: TokenLogprobs, delta: Delta) -> None:
        """One token's entry, with its text offset as vLLM counts it: where the token starts
        in the tokens' own texts joined (a token whose bytes end mid-character has no place
        in the answer's text)."""
        offset = self.offsets[-1] + len(self.logprobs[-1].token) if self.offsets else 0
        delta.logprobs.append(entry)
        delta.offsets.append(offset)
        self.logprobs.append(entry)
        self.offsets.append(offset)

    def choice_extra(self, chat: bool = False) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.options.prompt_logprobs is not None and not chat:
            extra["prompt_logprobs"] = self.prompt_logprobs  # vLLM: in a completion's choice
        if self.options.return_token_ids:
            extra.update(token_ids=self.token_ids, exit_depths=self.exit_depths)
        return extra

    def choice(self, chat: bool, index: int = 0) -> dict[str, Any]:
        """This answer as choice ``index`` of a non-streaming response."""
        logprobs = logprobs_body(chat, self.options, self.logprobs, self.offsets)
        extra = self.choice_extra(chat)
        if chat:
            return chat_choice(
                index, self.text, self.finish_reason, extra, logprobs, self.tool_calls
            )
        return completion_choice(index, self.text, self.finish_reason, extra, logprobs)

    def body(self, chat: bool, model: str, created: int) -> dict[str, Any]:
        """The non-streaming response of this one answer."""
        return answers_body(chat, self.request_id, model, created, [self])


def answers_body(
    chat: bool, request_id: str, model: str, created: int, answers: list[Answer]
) -> dict[str, Any]:
    """The non-streaming response of ``answers``, choice ``i`` from ``answers[i]``."""
    choices = [a.choice(chat, i) for i, a in enumerate(answers)]
    top = {}
    if chat and answers[0].options.prompt_logprobs is not None:
        # vLLM puts a chat's prompt_logprobs in the response, not in its choices
        top["prompt_logprobs"] = answers[0].prompt_logprobs
    return response_body(chat, request_id, model, created, choices, combined_usage(answers), top)


def combined_usage(answers: list[Answer]) -> Usage:
    """One response's usage: the prompt once (every choice has the same), the completion
    tokens of all choices."""
    # from a choice that heard the engine's count (one ended by a stop string and then a
    # timeout never did)
    counted = next((a for a in answers if a.num_prompt_tokens), answers[0])
    return Usage(
        counted.num_prompt_tokens,
        counted.num_cached_tokens,
        completion_tokens=sum(len(a.exit_depths) for a in answers),
        core_loops=sum(sum(a.exit_depths) for a in answers),
        shed_tokens=sum(a.num_shed_tokens for a in answers),
        prefill_rows=sum(a.num_prefill_rows for a in answers),
        accepted_draft_tokens=sum(a.num_accepted_draft_tokens for a in answers),
        rejected_draft_tokens=sum(
            a.num_draft_tokens - a.num_accepted_draft_tokens for a in answers
        ),
    )


def _top_only(entry: TokenLogprobs, n: int) -> TokenLogprobs:
    """The entry with at most ``n`` alternatives (the engine computed the most any part of
    the request asked for)."""
    if len(entry.top_logprobs) <= n:
        return entry
    return msgspec.structs.replace(entry, top_logprobs=entry.top_logprobs[:n])


def logprobs_body(
    chat: bool, options: Options, entries: list[TokenLogprobs], offsets: list[int]
) -> dict[str, Any] | None:
    """A choice's ``logprobs``: None unless the request asked for them."""
    if options.logprobs is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries, offsets)


class SseEncoder:
    """OpenAI's streaming chunks of choice ``index``, one ``data:`` frame each."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        created: int,
        options: Options,
        index: int = 0,
        answer: Answer | None = None,
    ):
        self.chat = chat
        self.options = options
        self.index = index
        # with continuous usage: whose prompt counts each frame reports, and the tokens this
        # encoder has framed so far and the loops they ran (the completion counted)
        self._answer = answer if options.continuous_usage else None
        self._framed_tokens = self._framed_loops = 0
        self._head = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._started = False
        # tokens whose text the detokenizer still holds: they go out with the next frame
        self._ids: list[int] = []
        self._depths: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._offsets: list[int] = []
        self._prompt_logprobs: list[dict[str, Any] | None] | None = None
        # a frame that only carries text is most frames: its bytes around the text are
        # fixed, so it is built by concatenation (the same bytes the general path makes)
        self._text_frame: tuple[bytes, bytes] | None = None
        plain = options.logprobs is None and options.prompt_logprobs is None
        if not options.return_token_ids and plain and self._answer is None:
            marker = "\x00"
            probe = self._frame({"content": marker} if chat else marker, None)
            before, after = probe.split(_JSON.encode(marker))
            self._text_frame = (before, after)

    def deltas(self, deltas: list[Delta]) -> bytes:
        frames = []
        if self.chat and not self._started:
            # the first chat chunk says who speaks (as OpenAI's does)
            self._started = True
            frames.append(self._frame({"role": "assistant", "content": ""}, None))
        for d in deltas:
            if self._answer is not None:  # only continuous usage counts what was framed
                self._framed_tokens += len(d.exit_depths)
                self._framed_loops += sum(d.exit_depths)
            if self.options.return_token_ids:  # the only frames that carry them
                self._ids += d.token_ids
                self._depths += d.exit_depths
            self._logprobs += d.logprobs
            self._offsets += d.offsets
            if d.prompt_logprobs is not None:
                self._prompt_logprobs = d.prompt_logprobs
            if not d.text and d.finish_reason is None and not d.tool_calls:
                continue  # bytes held by the detokenizer: nothing to show yet
            if self._text_frame is not None and d.finish_reason is None and not d.tool_calls:
                before, after = self._text_frame
                frames.append(before + _JSON.encode(d.text) + after)
                continue
            content: dict[str, Any] = {"content": d.text} if self.chat and d.text else {}
            if d.tool_calls:
                content["tool_calls"] = tool_call_chunks(d.tool_calls)
            frames.append(self._frame(content if self.chat else d.text, d.finish_reason))
        return b"".join(frames)

    def usage(self, usage: Usage) -> bytes:
        return _sse({**self._head, "choices": [], "usage": usage.body()})

    def error(self, code: str, message: str) -> bytes:
        return _sse(error_body(code, message))

    def _frame(self, delta: Any, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = None
        if self._logprobs:
            choice["logprobs"] = logprobs_body(
                self.chat, self.options, self._logprobs, self._offsets
            )
            self._logprobs, self._offsets = [], []
        choice["finish_reason"] = finish_reason
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if self._prompt_logprobs is not None:  # with the first frame: a chat's in the chunk
            (chunk if self.chat else choice)["prompt_logprobs"] = self._prompt_logprobs
            self._prompt_logprobs = None
        if self.options.return_token_ids:
            choice["token_ids"], self._ids = self._ids, []
            choice["exit_depths"], self._depths = self._depths, []
        if self._answer is not None:  # vLLM's continuous usage: the counts so far
            a = self._answer
            usage = Usage(
                a.num_prompt_tokens, a.num_cached_tokens, self._framed_tokens, self._framed_loops
            )
            chunk["usage"] = usage.body()
        elif self.options.include_usage:
            chunk["usage"] = None  # only the last chunk carries usage (OpenAI's rule)
        return _sse(chunk)


def tool_call_chunks(pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls``: one entry per call the pieces touch (a call's first
    entry with its id, type and name), its argument pieces joined."""
    entries: list[dict[str, Any]] = []
    for piece in pieces:
        if entries and entries[-1]["index"] == piece.index and piece.id is None:
            entries[-1]["function"]["arguments"] += piece.arguments
            continue
        entry: dict[str, Any] = {"index": piece.index}
        if piece.id is not None:
            entry.update(id=piece.id, type="function")
            entry["function"] = {"name": piece.name, "arguments": piece.arguments}
        else:
            entry["function"] = {"arguments": piece.arguments}
        entries.append(entry)
    return entries


def _sse(obj: Any) -> bytes:
    return b"data: " + _JSON.encode(obj) + b"\n\n"
