"""An answer's text read as content and tool calls, as it streams. Pure.

The engine held the output to the tool-call format (``services/common/structured/tool_format.py``):
free text (``auto`` only), then calls, each ``<trigger><begin>{"name": "...",
"arguments": ...}<end>``. ``ToolCallParser.push`` takes the text as it comes and returns
what can be shown already: content, and pieces of calls, a call's id and name as soon as
its name is complete, then its arguments as they are written. The arguments' end is found
by following the JSON's nesting (strings and escapes included), so the wrapper's closing
brace is never sent as arguments. A streamed answer and a whole one are built from the same
pieces, so their calls are the same text.

Content is what precedes the first call, without the blanks before it; text that could be
the start of the trigger is held back until the next text decides it. An answer cut short
(``max_tokens``) inside a call keeps the call as far as it got.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

from services.common.structured.tool_format import ToolFormat

# the call's JSON up to its arguments, as the grammar writes it (any blanks accepted)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# a head not found within this many characters is not one (never under the grammar): the
# text is shown as content
_MAX_HEAD = 256


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: the first piece brings its ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def body(self) -> dict[str, Any]:
        """OpenAI's shape of a call in a message."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class _Arguments:
    """Where the arguments' JSON stands: nesting depth, inside a string, after a backslash."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """How much of ``text`` belongs to the arguments when they end in it, else None
        (all of it does, and more is to come)."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1  # a string was the whole value
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:
                    return i  # the wrapper's brace after a bare value
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class ToolCallParser:
    format: ToolFormat
    request_id: str  # call ids are derived from it (``call_id``)
    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""  # text not shown yet
    _state: str = "content"  # content, head (after the trigger), arguments, tail
    _arguments: _Arguments = field(default_factory=_Arguments)

    @property
    def completed(self) -> int:
        return sum(c.complete for c in self.calls)

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and the call pieces ``text`` makes showable."""
        self._pending += text
        content: list[str] = []
        pieces: list[ToolCallDelta] = []
        while self._step(content, pieces):
            pass
        return "".join(content), pieces

    def flush(self) -> str:
        """The answer ended: the content held back (a call cut short stays as it is)."""
        rest, self._pending = self._pending, ""
        if self._state == "content" and not (self.calls and not rest.strip()):
            return rest
        return ""

    def _step(self, content: list[str], pieces: list[ToolCallDelta]) -> bool:
        """Consumes what it can of the pending text; False when it needs more."""
        if self._state == "content":
            return self._content(content)
        if self._state == "head":
            return self._head(content, pieces)
        if self._state == "arguments":
            return self._args(pieces)
        return self._tail()

    def _content(self, content: list[str]) -> bool:
        trigger, text = self.format.trigger, self._pending
        at = text.find(trigger)
        if at >= 0:
            if not self.calls:  # blanks between calls are the format's, not content
                content.append(text[:at].rstrip())
            self._pending = text[at + len(trigger) :]
            self._state = "head"
            return True
        held = _trigger_prefix(text, trigger)
        shown = text[: len(text) - held].rstrip()  # blanks wait: a call may follow them
        if shown and not self.calls:
            content.append(shown)
            self._pending = text[len(shown) :]
        return False

    def _head(self, content: list[str], pieces: list[ToolCallDelta]) -> bool:
        match = _HEAD.match(self._pending)
        if match is None:
            if len(self._pending) > _MAX_HEAD:  # not a call after all: show it
                content.append(self.format.trigger + self._pending)
                self._pending, self._state = "", "content"
            return False
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:  # an escape JSON does not know (never under the grammar)
            name = match.group(1)
        index = len(self.calls)
        call = ToolCall(call_id(self.request_id, index), name)
        self.calls.append(call)
        pieces.append(ToolCallDelta(index, call.id, name))
        self._pending = self._pending[match.end() :]
        self._state, self._arguments = "arguments", _Arguments()
        return True

    def _args(self, pieces: list[ToolCallDelta]) -> bool:
        text = self._pending
        if not self.calls[-1].arguments:  # blanks before the value are not its own
            text = self._pending = text.lstrip()
            if not text:
                return False
        end = self._arguments.end(text)
        taken = text if end is None else text[:end]
        if taken:
            self.calls[-1].arguments += taken
            pieces.append(ToolCallDelta(len(self.calls) - 1, arguments=taken))
        self._pending = "" if end is None else text[end:]
        if end is None:
            return False
        self._state = "tail"
        return True

    def _tail(self) -> bool:
        close = self.format.end.strip() or "}"
        at = self._pending.find(close)
        if at < 0:
            return False
        self.calls[-1].complete = True
        self._pending = self._pending[at + len(close) :]
        self._state = "content"
        return True


def call_id(request_id: str, index: int) -> str:
    """A call's id, a function of its answer's request id (OpenAI's ``call_`` prefix)."""
    digest = blake2b(f"{request_id}:{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def _trigger_prefix(text: str, trigger: str) -> int:
    """The length of the longest end of ``text`` that starts ``trigger``."""
    for size in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0
