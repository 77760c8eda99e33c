"""The dashboard's 15-minute history: one sample per second, kept in the router, bounded.

A `Reading` is the router's cumulative counters at one instant (finished requests, tokens, the
latency histograms' buckets, KV bytes per prefill -> decode link, fallbacks) plus what is only
ever instantaneous (KV usage per role). A sample is the difference between the newest reading
and the oldest one of a short trailing window, so a chart point is "the last 10 s", not one
noisy second. Latency percentiles come from the router's own `vllm:` histograms (bucket deltas
over that window, interpolated inside a bucket as Prometheus' histogram_quantile does), so they
need no timelines and agree with what a Prometheus would compute from /metrics.

Pure: no I/O, no clock; the sampler (router.ops.dashboard.sampler) feeds it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

HISTORY_CAPACITY = 900
"""Samples kept: 15 minutes at one per second."""
LATENCIES = ("ttft", "itl", "e2e")
QUANTILES = ((50, 0.5), (99, 0.99))

Buckets = tuple[tuple[float, float], ...]
"""Cumulative (upper bound, count) pairs in increasing bound order, the last bound +Inf."""


@dataclass(frozen=True)
class Reading:
    """Cumulative counters since the router started, at `at_unix`."""

    at_unix: float
    finished: float = 0.0
    """Backend requests finished (vllm:request_success, every reason)."""
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    latency: Mapping[str, Buckets] = field(default_factory=dict)
    """"ttft" / "itl" / "e2e" -> the histogram's cumulative buckets (seconds)."""
    links: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    """"prefill_id->decode_id" -> (bytes, seconds) of the KV transfers over that link."""
    fallbacks: Mapping[str, int] = field(default_factory=dict)
    """Reason -> requests that left the disaggregated path."""
    kv_usage: Mapping[str, float] = field(default_factory=dict)
    """Role -> fraction of its KV blocks in use now (instantaneous, not a counter)."""


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of the observations counted in `buckets` (Prometheus' histogram_quantile:
    linear inside the bucket holding rank q * total; the largest finite bound when that bucket
    is +Inf). None when the buckets count nothing."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return bound if inside <= 0 else lower + (bound - lower) * (rank - below) / inside
        lower, below = bound, count
    return lower


def bucket_delta(new: Buckets, old: Buckets) -> Buckets:
    """Counts observed between two readings of one histogram (same bounds)."""
    before = dict(old)
    return tuple((bound, count - before.get(bound, 0.0)) for bound, count in new)


def _rate(new: float, old: float, seconds: float) -> float | None:
    return (new - old) / seconds if seconds > 0 else None


def sample(old: Reading, new: Reading) -> dict[str, float | None]:
    """One history point from the window's oldest and newest readings (rates per second,
    latencies in ms, KV usage in percent, transfer speed in GB/s, fallbacks per minute).
    A latency is None when nothing finished in the window; a link's GB/s is None when it
    moved nothing (no transfer is not a speed of 0)."""
    dt = new.at_unix - old.at_unix
    values: dict[str, float | None] = {
        "request_rate": _rate(new.finished, old.finished, dt),
        "prompt_tokens_per_s": _rate(new.prompt_tokens, old.prompt_tokens, dt),
        "generation_tokens_per_s": _rate(new.generation_tokens, old.generation_tokens, dt),
    }
    for name in LATENCIES:
        window = bucket_delta(new.latency.get(name, ()), old.latency.get(name, ()))
        for label, q in QUANTILES:
            seconds = quantile(q, window)
            values[f"{name}_p{label}_ms"] = None if seconds is None else seconds * 1000
    for role, usage in new.kv_usage.items():
        values[f"kv_usage.{role}"] = usage * 100
    for link, (nbytes, seconds) in new.links.items():
        old_bytes, old_seconds = old.links.get(link, (0, 0.0))
        moved, took = nbytes - old_bytes, seconds - old_seconds
        values[f"transfer_gbps.{link}"] = moved / took / 1e9 if moved > 0 and took > 0 else None
    for reason, count in new.fallbacks.items():
        per_s = _rate(count, old.fallbacks.get(reason, 0), dt)
        values[f"fallbacks.{reason}"] = None if per_s is None else per_s * 60
    return values


def _rounded(value: float | None) -> float | None:
    """Four significant digits: the charts need no more, the JSON gets much shorter."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, 3 - int(math.floor(math.log10(abs(value)))))


class History:
    """The last `capacity` samples (memory bounded: capacity rows of a few dozen numbers)."""

    def __init__(self, capacity: int = HISTORY_CAPACITY, interval_s: float = 1.0) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.interval_s = interval_s
        self._rows: deque[tuple[float, dict[str, float | None]]] = deque(maxlen=capacity)

    def append(self, at_unix: float, values: Mapping[str, float | None]) -> None:
        self._rows.append((at_unix, {k: _rounded(v) for k, v in values.items()}))

    def __len__(self) -> int:
        return len(self._rows)

    def to_json(self, since: float | None = None) -> dict[str, object]:
        """Column form for the charts (uPlot's aligned arrays): the times of the samples
        after `since` (all when None) and one array per series, null where a series has no
        value (a link that did not exist yet, a window with no finished request)."""
        rows = [row for row in self._rows if since is None or row[0] > since]
        names = sorted({name for _, values in rows for name in values})
        return {
            "interval_s": self.interval_s,
            "capacity": self.capacity,
            "t": [round(at, 3) for at, _ in rows],
            "series": {name: [values.get(name) for _, values in rows] for name in names},
        }
