"""A progress bar on stderr: tqdm when installed, else one plain line per step."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm  # optional: a dev extra, imported only when benching
            except ImportError:
                self._bar = None
            else:
                self._bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)

    def describe(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(text, refresh=True)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
