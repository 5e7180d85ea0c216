"""String stops on a detokenized stream (OpenAI's ``stop``), applied by the gateway.

The engine stops on token ids; a stop *string* can end in the middle of a token or span
several, so it is matched on the text. ``StopMatcher.push`` takes each text delta and
returns the text that is safe to show: everything before the earliest stop string, minus
a tail that could still turn out to be the start of one (held back until the next delta
settles it). The output never contains a stop string (unless
``include_stop_str_in_output``), and nothing shown is ever taken back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.include_stop_str = include_stop_str
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, delta: str) -> str:
        """The text to emit for ``delta``; after a match, always ""."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        found = self._earliest(text)
        if found is not None:
            index, stop = found
            self.matched = stop
            self._held = ""
            return text[: index + len(stop)] if self.include_stop_str else text[:index]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the stream: what was held back was not a stop after all."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _earliest(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that some stop string starts with."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
