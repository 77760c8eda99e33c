"""vLLM's serving metrics from per-request outputs (pure: no I/O).

Definitions (as `vllm bench serve`):
  - TTFT: send to first token; E2EL: send to last token;
  - TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
  - ITL: every gap between consecutive token chunks, pooled over requests;
  - goodput: completed requests per second that meet every SLO given (ttft, tpot, e2el, in
    ms; a request with one output token has TPOT 0 for this);
  - percentiles: numpy's linear interpolation; metrics with no sample report 0.
Throughputs divide by the run's duration; failed requests count in no metric but `failed`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
ALWAYS_PERCENTILES = (90.0, 99.0)
"""Written to the JSON whatever --metric-percentiles says."""
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class MetricStats:
    """One latency metric over a run, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]
    """(percentile, value) pairs, ascending."""


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    stats: Mapping[str, MetricStats]
    """METRICS name -> its stats."""
    output_lens: tuple[int, ...]
    """Per request; 0 for a failed one."""
    tokens_per_second: tuple[int, ...]
    """Output tokens that arrived in each second of the run (from the first send)."""
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    delivery: MetricStats | None = None
    """Token delivery delay (sample on the server -> arrival here), pooled over tokens; None
    when the server sent no sample times."""


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (the JSON key and printed label use it)."""
    return str(int(p)) if int(p) == p else str(p)


def metric_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """Stats in ms of values given in seconds."""
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return MetricStats(
        mean=float(np.mean(data)), median=float(np.median(data)), std=float(np.std(data)),
        percentiles=tuple((float(p), float(np.percentile(data, p))) for p in sorted(set(percentiles))),
    )


def tpot_s(output: RequestOutput) -> float:
    """TPOT in seconds; 0 when there was at most one output token."""
    if output.output_tokens <= 1:
        return 0.0
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def meets_slos(output: RequestOutput, slos_ms: Mapping[str, float]) -> bool:
    measured_s = {"ttft": output.ttft, "tpot": tpot_s(output), "e2el": output.latency}
    return all(measured_s[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Every metric of a run. Percentiles computed are `percentiles` plus 90 and 99."""
    unknown = set(goodput_slos_ms or {}) - set(GOODPUT_METRICS)
    if unknown:
        raise ValueError(f"goodput metric(s) {sorted(unknown)} unknown; use {', '.join(GOODPUT_METRICS)}")
    ok = [o for o in outputs if o.success]
    samples = {
        "ttft": [o.ttft for o in ok],
        "tpot": [tpot_s(o) for o in ok if o.output_tokens > 1],
        "itl": [gap for o in ok for gap in o.itl],
        "e2el": [o.latency for o in ok],
    }
    wanted = [*percentiles, *ALWAYS_PERCENTILES]
    total_output = sum(o.output_tokens for o in ok)
    total_input = sum(o.prompt_len for o in ok)
    good = sum(meets_slos(o, goodput_slos_ms) for o in ok) if goodput_slos_ms else 0
    per_second = tokens_per_second(ok)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / duration_s, request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats={name: metric_stats(samples[name], wanted) for name in METRICS},
        output_lens=tuple(o.output_tokens if o.success else 0 for o in outputs),
        tokens_per_second=per_second, max_output_tokens_per_s=float(max(per_second, default=0)),
        max_concurrent_requests=peak_concurrency(ok),
        delivery=_delivery([d for o in ok for d in o.delivery], wanted),
    )


def _delivery(samples_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats | None:
    return metric_stats(samples_s, percentiles) if samples_s else None


def token_times(output: RequestOutput) -> list[float]:
    """Arrival time (perf_counter seconds) of each token chunk of a request."""
    times = [output.start_time + output.ttft]
    for gap in output.itl:
        times.append(times[-1] + gap)
    return times


def tokens_per_second(outputs: Sequence[RequestOutput]) -> tuple[int, ...]:
    """Token chunks arriving in each whole second from the first request's send."""
    if not outputs:
        return ()
    origin = min(o.start_time for o in outputs)
    end = max(o.start_time + o.latency for o in outputs)
    buckets = [0] * (math.ceil(end - origin) + 1)
    for o in outputs:
        for t in token_times(o):
            buckets[int(t - origin)] += 1
    return tuple(buckets)


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at one instant (intervals [start, start + latency))."""
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs])
    peak = current = 0
    for _, delta in events:  # at equal times -1 sorts first: an end frees its slot first
        current += delta
        peak = max(peak, current)
    return peak
