"""Stop strings over a stream of text deltas (pure: no tokenizer, no I/O).

Semantics are vLLM's: generation ends where a stop string first appears in the output text; the
output is cut before it, or just after it with `include_stop_str_in_output`. A stop string may be
split over several deltas, so text that could be the start of one is held back until the next
delta settles it. With `include_stop_str_in_output` nothing needs holding back (text before and
inside a stop string is output either way), as in vLLM.

Two deliberate refinements, neither of which changes the final text for one-token deltas:
- Only a tail that is a proper prefix of some stop string is held back (vLLM always holds back the
  last `max(len(stop)) - 1` characters), so ordinary text streams without delay.
- When several stop strings complete within one delta, the one that completes first in the text
  wins (vLLM takes the first in list order); that is where a character-by-character stream stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    """The outcome of feeding one delta."""

    text: str
    """Text that may be sent to the client now."""
    matched: str | None
    """The stop string found in this delta; None while generation may go on."""


class StopStringMatcher:
    """Watches one request's output text for stop strings. Not thread-safe; one per request."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """Raises ValueError for an empty stop string."""
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._text = ""  # every character fed so far
        self._emitted = 0  # how many of them have been returned
        self._done = False

    @property
    def finished(self) -> bool:
        """True once a stop string matched or flush() was called."""
        return self._done

    def feed(self, delta: str) -> StopCheck:
        """Add `delta` to the output; return what may be emitted now and any stop string matched.

        After a match the request is over: feeding again raises RuntimeError.
        """
        if self._done:
            raise RuntimeError("StopStringMatcher fed after a stop string matched or after flush()")
        searched_up_to = len(self._text)
        self._text += delta
        match = self._first_match(searched_up_to)
        if match is not None:
            stop_str, start = match
            end = start + len(stop_str) if self._include else start
            self._done = True
            return StopCheck(text=self._take(end), matched=stop_str)
        return StopCheck(text=self._take(len(self._text) - self._held_back()), matched=None)

    def flush(self) -> str:
        """Text still held back, for when generation ends for another reason (EOS, length)."""
        self._done = True
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        # Emitted text is never taken back: callers only pass `end` >= what was already emitted.
        assert end >= self._emitted, f"stop cut at {end} but {self._emitted} chars already emitted"
        out = self._text[self._emitted : end]
        self._emitted = end
        return out

    def _first_match(self, searched_up_to: int) -> tuple[str, int] | None:
        """(stop string, start) of the match that ends first among those ending in the new text."""
        best: tuple[int, int, str] | None = None  # (end, list position, stop string)
        for position, stop_str in enumerate(self._stop):
            # A match found now must end after `searched_up_to`, so it starts at most
            # len(stop_str) - 1 characters before it.
            start = self._text.find(stop_str, max(0, searched_up_to - len(stop_str) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop_str), position, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[2], best[0] - len(best[2]))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self._include:
            return 0
        longest = 0
        for stop_str in self._stop:
            for n in range(min(len(stop_str) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop_str[:n]):
                    longest = n
                    break
        return min(longest, len(self._text) - self._emitted)
