"""A text progress bar on stderr, redrawn at most a few times a second (cheap: the client's
own CPU use is part of what a benchmark reports)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.25
WIDTH = 30


class ProgressBar:
    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self._enabled = enabled
        self._stream = stream or sys.stderr
        self._start = time.perf_counter()
        self._drawn = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self._enabled and (now - self._drawn >= REDRAW_S or self.done == self.total):
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = WIDTH * self.done // max(self.total, 1)
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        failed = f", {self.failed} failed" if self.failed else ""
        self._stream.write(f"\r|{'#' * filled}{' ' * (WIDTH - filled)}| {self.done}/{self.total} "
                           f"[{elapsed:.1f}s, {rate:.2f} req/s{failed}]")
        if self.done == self.total:
            self._stream.write("\n")
        self._stream.flush()
