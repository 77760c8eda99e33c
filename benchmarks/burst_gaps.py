"""Which short-chat token gaps the long prompts touched, and how: for disagg_vs_colocated.py.

With bursts of long prompts beside a stream of short chats, a gap between two streamed tokens
of a short chat can grow for two different reasons on the decode worker:

- a long prompt is being prefilled and its KV is arriving (sent -> its first token): the
  decode worker receives and writes the KV beside its steps. This is what disaggregation
  promises to keep out of decode ("decode that does not feel prefill").
- a long prompt is decoding (its first token -> its last): it is in the same decode batch, and
  a step attends over its ~2k tokens of context as well as over the short chats' few hundred.
  That cost is the decode step's own, whichever worker did the prefill.

A third reason lies in the load, not the decode step: short chats whose prefills waited together
reach the decode worker together, and its batch, so every step, grows. `by_batch` groups the
gaps by the decode batch they fell in (how many short chats and long prompts were decoding at
the gap's midpoint), so the same batch can be compared with and without bursts: equal gaps at
equal batches mean the step did not feel the prefill, and a batch that is larger more often
means the arrivals bunched.

Each gap goes in one class, by the windows it overlaps (the send and arrival times of the bench
JSON, perf_counter seconds, one clock for both bench processes on this host): "long decoding"
if it overlaps a long prompt's decode window, else "long arriving" if it overlaps one's
prefill window, else "neither".
"""

from __future__ import annotations

import math
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


BIG_BATCH = 5
"""Short chats decoding at once from which a batch counts as a bunch (batch_summary)."""
MIN_GAPS = 20
"""Fewest gaps a batch size needs in both phases for its medians to be compared."""


def _decoding(bench: dict) -> list[Window]:
    """First token -> last token of each request that succeeded."""
    return windows(bench)[1]


def by_batch(short: dict, long: dict | None = None) -> dict[tuple[int, int], list[float]]:
    """Gap lengths in seconds by (short chats decoding, long prompts decoding) at the gap's
    midpoint; the gap's own chat counts."""
    chats, longs = _decoding(short), _decoding(long) if long is not None else []
    out: dict[tuple[int, int], list[float]] = {}
    for begin, end in gaps(short):
        mid = (begin + end) / 2
        key = (sum(a <= mid < b for a, b in chats), sum(a <= mid < b for a, b in longs))
        out.setdefault(key, []).append(end - begin)
    return out


@dataclass(frozen=True)
class BatchSummary:
    """Steady against bursts, gaps grouped by decode batch (pooled over the rounds)."""

    median_ratios: tuple[tuple[int, float], ...]
    """(short chats decoding, bursts / steady median gap) for batches with no long prompt
    decoding and at least MIN_GAPS gaps in both phases."""
    big_steady: float
    """Share of steady's gaps in batches of BIG_BATCH or more short chats."""
    big_bursts: float


def batch_summary(steady: Sequence[dict], bursts: Sequence[tuple[dict, dict]]) -> BatchSummary:
    """`steady`: each round's steady bench JSON; `bursts`: each round's (short, long) JSON."""
    def pooled(groups: list[dict[tuple[int, int], list[float]]]) -> dict[tuple[int, int], list[float]]:
        out: dict[tuple[int, int], list[float]] = {}
        for group in groups:
            for key, values in group.items():
                out.setdefault(key, []).extend(values)
        return out

    calm = pooled([by_batch(s) for s in steady])
    busy = pooled([by_batch(s, l) for s, l in bursts])
    ratios = tuple((n, float(np.median(busy[(n, 0)]) / np.median(calm[(n, 0)])))
                   for n in sorted({n for n, longs in calm if longs == 0})
                   if len(calm[(n, 0)]) >= MIN_GAPS and len(busy.get((n, 0), ())) >= MIN_GAPS)

    def big(groups: dict[tuple[int, int], list[float]]) -> float:
        total = sum(len(v) for v in groups.values())
        return sum(len(v) for (n, _), v in groups.items() if n >= BIG_BATCH) / total if total else math.nan

    return BatchSummary(ratios, big(calm), big(busy))
