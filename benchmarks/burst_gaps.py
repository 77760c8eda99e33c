"""Which short-chat token gaps the long prompts touched, and how: for disagg_vs_colocated.py.

With bursts of long prompts beside a stream of short chats, a gap between two streamed tokens
of a short chat can grow for two different reasons on the decode worker:

- a long prompt is being prefilled and its KV is arriving (sent -> its first token): the
  decode worker receives and writes the KV beside its steps. This is what disaggregation
  promises to keep out of decode ("decode that does not feel prefill").
- a long prompt is decoding (its first token -> its last): it is in the same decode batch, and
  a step attends over its ~2k tokens of context as well as over the short chats' few hundred.
  That cost is the decode step's own, whichever worker did the prefill.

Each gap goes in one class, by the windows it overlaps (the send and arrival times of the bench
JSON, perf_counter seconds, one clock for both bench processes on this host): "long decoding"
if it overlaps a long prompt's decode window, else "long arriving" if it overlaps one's
prefill window, else "neither".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CLASSES = ("long decoding", "long arriving", "neither")

Window = tuple[float, float]


@dataclass(frozen=True)
class GapClass:
    """The gaps of one class in one phase."""

    name: str
    count: int
    share: float
    """Of all the phase's gaps."""
    p99_ms: float
    """NaN when the class has no gap."""


def windows(long: dict) -> tuple[list[Window], list[Window]]:
    """(arriving, decoding) windows of the long prompts that succeeded: sent -> first token,
    first token -> last token."""
    arriving, decoding = [], []
    for start, ttft, latency, error in zip(long["start_times"], long["ttfts"], long["latencies"], long["errors"]):
        if error or not latency:
            continue
        arriving.append((start, start + ttft))
        decoding.append((start + ttft, start + latency))
    return arriving, decoding


def gaps(short: dict) -> list[Window]:
    """Every gap between two streamed chunks of the short chats, as (begin, end)."""
    out = []
    for start, ttft, itl, error in zip(short["start_times"], short["ttfts"], short["itls"], short["errors"]):
        if error:
            continue
        t = start + ttft
        for gap in itl:
            out.append((t, t + gap))
            t += gap
    return out


def _overlaps(gap: Window, spans: Sequence[Window]) -> bool:
    return any(gap[0] < end and begin < gap[1] for begin, end in spans)


def classify(short: dict, long: dict) -> dict[str, list[float]]:
    """Gap lengths in seconds by class (CLASSES, in that order of precedence)."""
    arriving, decoding = windows(long)
    by_class: dict[str, list[float]] = {name: [] for name in CLASSES}
    for gap in gaps(short):
        name = "long decoding" if _overlaps(gap, decoding) else "long arriving" if _overlaps(gap, arriving) else "neither"
        by_class[name].append(gap[1] - gap[0])
    return by_class


def gap_classes(short: dict, long: dict) -> list[GapClass]:
    """Count, share and p99 (numpy's linear interpolation, as pdserve bench) of each class."""
    by_class = classify(short, long)
    total = sum(len(v) for v in by_class.values()) or 1
    return [GapClass(name, len(v), len(v) / total, float(np.percentile(v, 99)) * 1e3 if v else float("nan"))
            for name, v in by_class.items()]
