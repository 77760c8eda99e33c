"""Periodic stats lines, like vLLM's engine log: throughput, requests, KV usage, prefix-cache hit
rate and KV transfers, every `--log-stats-interval` seconds, only when the line changed.

    Avg prompt throughput: 51.2 tokens/s, Avg generation throughput: 12.8 tokens/s, Running: 1 reqs,
    Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 25.0%, KV transfers: 0.4/s, 0.001 GB/s

A worker logs its own (worker_runtime/stats_log.py); the router logs the cluster's, summed over
its snapshot of the workers' heartbeats (ClusterStats below). Rates are over the last interval;
the hit rate is over the prompt tokens looked up in it (0 when none were). A line that equals
the previous one (an idle cluster: zero rates, the same gauges) is not logged again, and the
state at start-up counts as the previous line, so an idle process logs nothing.

The sampling and text are pure (StatsSample, stats_text, StatsTicker); the drivers own the
clock and the thread or task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.cluster.keys import ClusterSnapshot
from router.cluster.view import role_totals

__all__ = ["ClusterStats", "StatsSample", "StatsTicker", "run_cluster_stats", "stats_fields", "stats_text"]

logger = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class StatsSample:
    """Counters (since start, never decreasing) and gauges at one moment."""

    taken_at: float
    """Monotonic seconds."""
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    transfers: int
    transfer_bytes: int
    running: int
    waiting: int
    kv_usage: tuple[tuple[str, float], ...]
    """(label, fraction used): one pair with label "" for a worker, one per role for the cluster."""


def stats_fields(prev: StatsSample, cur: StatsSample) -> dict[str, float | int | dict[str, float]]:
    """The numbers of a stats line (a JSON log line's `stats` object): rates over prev -> cur."""
    seconds = max(cur.taken_at - prev.taken_at, 1e-9)
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    return {
        "prompt_throughput": round((cur.prompt_tokens - prev.prompt_tokens) / seconds, 1),
        "generation_throughput": round((cur.generation_tokens - prev.generation_tokens) / seconds, 1),
        "running": cur.running,
        "waiting": cur.waiting,
        "kv_cache_usage": {label: round(100 * used, 1) for label, used in cur.kv_usage},
        "prefix_cache_hit_rate": round(100 * hits / queries, 1) if queries > 0 else 0.0,
        "transfers_per_s": round((cur.transfers - prev.transfers) / seconds, 1),
        "transfer_gb_per_s": round((cur.transfer_bytes - prev.transfer_bytes) / GB / seconds, 3),
    }


def stats_text(fields: dict) -> str:
    """vLLM's wording, plus KV transfers."""
    usage = ", ".join(f"{label} {pct:.1f}%" if label else f"{pct:.1f}%"
                      for label, pct in fields["kv_cache_usage"].items())
    return (f"Avg prompt throughput: {fields['prompt_throughput']:.1f} tokens/s, "
            f"Avg generation throughput: {fields['generation_throughput']:.1f} tokens/s, "
            f"Running: {fields['running']} reqs, Waiting: {fields['waiting']} reqs, "
            f"KV cache usage: {usage}, Prefix cache hit rate: {fields['prefix_cache_hit_rate']:.1f}%, "
            f"KV transfers: {fields['transfers_per_s']:.1f}/s, {fields['transfer_gb_per_s']:.3f} GB/s")


class StatsTicker:
    """Turns samples into lines: `tick(sample)` is the line to log, or None when it would repeat
    the previous one. Not thread-safe: one driver calls it."""

    def __init__(self, first: StatsSample) -> None:
        """first: the state at start-up (its idle line counts as already logged)."""
        self._prev = first
        self._last_text = stats_text(stats_fields(first, first))

    def tick(self, sample: StatsSample) -> tuple[str, dict] | None:
        """(line, its numbers), or None when the line equals the last one logged."""
        fields = stats_fields(self._prev, sample)
        self._prev = sample
        text = stats_text(fields)
        if text == self._last_text:
            return None
        self._last_text = text
        return text, fields


class ClusterStats:
    """The cluster's counters from successive snapshots: each worker's counters are taken as
    deltas against its previous heartbeat of the same incarnation, so a restarted worker (new
    incarnation, counters from 0) or one that left never makes a total go down, and a worker
    first seen adds nothing until its next heartbeat."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._totals = [0, 0, 0, 0]

    def sample(self, snapshot: ClusterSnapshot, transfers: int, transfer_bytes: int, router_waiting: int,
               now: float) -> StatsSample:
        """transfers, transfer_bytes: the router's own KV transfer totals (as its prefills
        reported them); router_waiting: requests in its admission queue."""
        for w in snapshot.workers:
            counters = (w.prompt_tokens, w.generation_tokens, w.prefix_cache_queries, w.prefix_cache_hits)
            # First sighting: a baseline (its past is not this interval's work); a new
            # incarnation of a known worker: its counters started from 0.
            incarnation, before = self._seen.get(w.worker_id, (w.incarnation, counters))
            if incarnation != w.incarnation:
                before = (0, 0, 0, 0)
            for i, (now_value, then_value) in enumerate(zip(counters, before)):
                self._totals[i] += max(now_value - then_value, 0)
            self._seen[w.worker_id] = (w.incarnation, counters)
        usage = tuple((role, float(role_totals(snapshot.members(role))["kv_cache_usage_perc"]))
                      for role in ("prefill", "decode"))
        return StatsSample(now, *self._totals, transfers=transfers, transfer_bytes=transfer_bytes,
                           running=sum(w.num_running for w in snapshot.workers),
                           waiting=router_waiting + sum(w.num_waiting for w in snapshot.workers),
                           kv_usage=usage)


async def run_cluster_stats(snapshot: Callable[[], Awaitable[ClusterSnapshot]], backend, interval_s: float,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """The router's cluster line every interval_s until cancelled. backend: its ClusterBackend
    (transfer totals, admission queue). A failed snapshot skips one line, never ends the task."""
    stats = ClusterStats()

    async def sample() -> StatsSample:
        t = backend.transfers
        return stats.sample(await snapshot(), t.count, t.nbytes, backend.admission.num_waiting, clock())

    ticker = StatsTicker(await sample())
    while True:
        await asyncio.sleep(interval_s)
        try:
            line = ticker.tick(await sample())
        except Exception as exc:  # noqa: BLE001 — a stats line must never stop the router
            logger.debug("cluster stats skipped: %s", exc)
            continue
        if line is not None:
            logger.info("Cluster: %s", line[0], extra={"stats": line[1]})
