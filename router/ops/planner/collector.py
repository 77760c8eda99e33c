"""The planner's live measurements: samples of the cluster and the router, and the PlanInputs a
window of them gives.

Every `interval_s` the collector takes a `Sample`: the workers' heartbeats (their cumulative
token counters and busy seconds, queues, KV size) and the router's own request totals (the
`vllm:` counters and latency histograms of router.serving.metrics, read from its registry).
`measure` turns the samples of the last window into rates and per-worker throughputs by
differences (newest minus oldest), so nothing is summed by hand and a sample lost costs only
resolution. Memory is bounded: a deque of window_s / interval_s samples.

A worker restarted in the window (new incarnation, counters from zero) is left out of the
differences; its lifetime counters still give a throughput when nothing else does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.ops.planner.model import PlanInputs

logger = logging.getLogger(__name__)

MIN_BUSY_S = 0.2
"""Busy seconds below which a throughput is noise (a few steps), not a measurement."""


@dataclass(frozen=True)
class RouterTotals:
    """The router's counters since it started. requests and the finished_* sums move when a
    backend request ends; prompt_tokens at dispatch and generation_tokens as tokens stream."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished_prompt_tokens: float = 0.0
    finished_generation_tokens: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    """(upper bound in seconds, cumulative count), ascending, +inf last."""
    itl_buckets: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Sample:
    at: float
    """Monotonic seconds."""
    workers: tuple[WorkerInfo, ...]
    router: RouterTotals
    admission_waiting: int = 0
    """Requests waiting in the router's admission queue for decode room."""


_TOTALS = {"vllm:request_success_total": "requests", "vllm:prompt_tokens_total": "prompt_tokens",
           "vllm:generation_tokens_total": "generation_tokens",
           "vllm:request_prompt_tokens_sum": "finished_prompt_tokens",
           "vllm:request_generation_tokens_sum": "finished_generation_tokens"}
_HISTOGRAMS = {"vllm:time_to_first_token_seconds_bucket": "ttft_buckets",
               "vllm:inter_token_latency_seconds_bucket": "itl_buckets"}


def router_totals(registry) -> RouterTotals:
    """The totals in a prometheus CollectorRegistry holding router.serving.metrics' series
    (summed over label sets). Reads only those collectors (restricted_registry)."""
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in registry.restricted_registry([*_TOTALS, *_HISTOGRAMS]).collect():
        for s in family.samples:
            if s.name in _TOTALS:
                sums[_TOTALS[s.name]] = sums.get(_TOTALS[s.name], 0.0) + s.value
            elif s.name in _HISTOGRAMS:
                into = buckets.setdefault(_HISTOGRAMS[s.name], {})
                bound = float(s.labels["le"])
                into[bound] = into.get(bound, 0.0) + s.value
    return RouterTotals(**sums, **{name: tuple(sorted(b.items())) for name, b in buckets.items()})


def quantile_ms(new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]], q: float) -> float | None:
    """The q-quantile (ms) of the observations between two cumulative histograms, interpolated
    within its bucket as Prometheus' histogram_quantile does; None when nothing was observed.
    A quantile in the +Inf bucket is the largest finite bound."""
    before = dict(old)
    counts = [(bound, count - before.get(bound, 0.0)) for bound, count in new]
    if not counts or counts[-1][1] <= 0:
        return None
    target, lower, below = q * counts[-1][1], 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= target:
            if math.isinf(bound):
                return lower * 1000
            inside = cumulative - below
            return (lower + (bound - lower) * ((target - below) / inside if inside > 0 else 1.0)) * 1000
        lower, below = bound, cumulative
    return lower * 1000


def _window(samples: Sequence[Sample], window_s: float) -> list[Sample]:
    newest = samples[-1].at
    return [s for s in samples if s.at >= newest - window_s - 1e-9]


def _same_run(old: Sample, new: Sample) -> list[tuple[WorkerInfo, WorkerInfo]]:
    """(old, new) heartbeats of each worker present in both with the same incarnation."""
    before = {(w.worker_id, w.incarnation): w for w in old.workers}
    return [(before[(w.worker_id, w.incarnation)], w) for w in new.workers if (w.worker_id, w.incarnation) in before]


def _throughput(pairs, latest: Sequence[WorkerInfo], tokens: str, busy: str) -> float | None:
    """Tokens per busy second of a role: over the window when it was busy enough, else over
    its workers' lifetimes (a worker idle now still ran at some speed), else None."""
    d_busy = sum(getattr(n, busy) - getattr(o, busy) for o, n in pairs)
    if d_busy >= MIN_BUSY_S:
        return sum(getattr(n, tokens) - getattr(o, tokens) for o, n in pairs) / d_busy
    life_busy = sum(getattr(w, busy) for w in latest)
    return sum(getattr(w, tokens) for w in latest) / life_busy if life_busy >= MIN_BUSY_S else None


def _rate(pairs, tokens: str, dt: float) -> float:
    """Tokens per second the workers of a role computed over the window (all routers' traffic)."""
    return sum(getattr(n, tokens) - getattr(o, tokens) for o, n in pairs) / dt if dt > 0 else 0.0


def _utilization(pairs, busy: str, dt: float) -> float:
    if not pairs or dt <= 0:
        return 0.0
    return min(sum(getattr(n, busy) - getattr(o, busy) for o, n in pairs) / (dt * len(pairs)), 1.0)


def _decoders(sample: Sample) -> tuple[WorkerInfo, ...]:
    return tuple(w for w in sample.workers if w.serves_decode)


def _prefillers(sample: Sample) -> tuple[WorkerInfo, ...]:
    return tuple(w for w in sample.workers if w.role == "prefill")


def measure(samples: Sequence[Sample], window_s: float, current_prefill: int, current_decode: int) -> PlanInputs:
    """The planner's inputs from the samples of the last window_s seconds (oldest first)."""
    if not samples:
        return PlanInputs(window_s=window_s, current_prefill=current_prefill, current_decode=current_decode)
    kept = _window(samples, window_s)
    old, new = kept[0], kept[-1]
    dt = new.at - old.at
    d = {name: getattr(new.router, name) - getattr(old.router, name)
         for name in ("requests", "prompt_tokens", "generation_tokens", "finished_prompt_tokens",
                      "finished_generation_tokens")}
    pairs = _same_run(old, new)
    prefill_pairs = [(o, n) for o, n in pairs if n.role == "prefill"]
    decode_pairs = [(o, n) for o, n in pairs if n.serves_decode]
    running = [sum(w.num_running for w in _decoders(s)) for s in kept]
    batches = [r / len(_decoders(s)) for r, s in zip(running, kept) if _decoders(s)]
    decoders = _decoders(new)
    return PlanInputs(
        window_s=window_s, current_prefill=current_prefill, current_decode=current_decode,
        prompt_tokens_per_s=d["prompt_tokens"] / dt if dt > 0 else 0.0,
        output_tokens_per_s=d["generation_tokens"] / dt if dt > 0 else 0.0,
        mean_request_tokens=(d["finished_prompt_tokens"] + d["finished_generation_tokens"]) / d["requests"]
        if d["requests"] > 0 else 0.0,  # finished requests only: the token counters lead them
        prefill_computed_tokens_per_s=_rate(prefill_pairs, "prompt_tokens", dt),
        decode_generated_tokens_per_s=_rate(decode_pairs, "generation_tokens", dt),
        prefill_tokens_per_busy_s=_throughput(prefill_pairs, _prefillers(new), "prompt_tokens", "prefill_busy_s"),
        decode_tokens_per_busy_s=_throughput(decode_pairs, decoders, "generation_tokens", "decode_busy_s"),
        prefill_utilization=_utilization(prefill_pairs, "prefill_busy_s", dt),
        decode_utilization=_utilization(decode_pairs, "decode_busy_s", dt),
        queued_prefill_tokens=sum(w.queued_prefill_tokens for w in _prefillers(new)),
        decode_running=sum(running) / len(running) + new.admission_waiting,
        decode_batch=sum(batches) / len(batches) if batches else 0.0,
        kv_tokens_per_decode_worker=(sum(w.total_blocks * w.block_size for w in decoders) // len(decoders)
                                     if decoders else 0),
        ttft_p99_ms=quantile_ms(new.router.ttft_buckets, old.router.ttft_buckets, 0.99),
        itl_p99_ms=quantile_ms(new.router.itl_buckets, old.router.itl_buckets, 0.99),
    )


class PlanCollector:
    """Takes a Sample every interval_s (run()), keeps the last window's worth."""

    def __init__(self, snapshot: Callable[[], Awaitable[ClusterSnapshot]], read_router: Callable[[], RouterTotals],
                 read_waiting: Callable[[], int], window_s: float, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0 or not interval_s > 0:
            raise ValueError(f"window_s and interval_s must be > 0; got {window_s}, {interval_s}")
        self._snapshot = snapshot
        self._read_router = read_router
        self._read_waiting = read_waiting
        self.window_s = window_s
        self.interval_s = interval_s
        self._clock = clock
        self.samples: deque[Sample] = deque(maxlen=math.ceil(window_s / interval_s) + 2)

    async def sample(self) -> Sample:
        """Take one sample now and keep it."""
        snapshot = await self._snapshot()
        sample = Sample(self._clock(), snapshot.workers, self._read_router(), self._read_waiting())
        self.samples.append(sample)
        return sample

    def inputs(self, current_prefill: int, current_decode: int) -> PlanInputs:
        return measure(list(self.samples), self.window_s, current_prefill, current_decode)

    async def run(self) -> None:
        """Sample every interval_s until cancelled; a failed sample is logged and skipped."""
        while True:
            try:
                await self.sample()
            except Exception:  # noqa: BLE001 — the planner must not take the router down
                logger.exception("planner sample failed; the next one is in %g s", self.interval_s)
            await asyncio.sleep(self.interval_s)
