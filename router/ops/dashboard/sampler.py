"""The dashboard's sampler: once a second, read the router's counters into the history.

Reads (never writes) what the router already keeps: its request metrics' registry (the `vllm:`
counters and latency histograms), the ClusterBackend's per-link transfer totals and fallback
counts, and the cluster snapshot's KV blocks per role. It is one asyncio task, started and
stopped with the router: each step is bounded (the snapshot never waits on Redis for more than
the reader's own timeout), a failing step is logged and skipped, and stop() cancels it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry

from router.cluster.keys import ClusterSnapshot
from router.cluster.view import role_totals
from router.ops.dashboard.history import Buckets, History, Reading, sample
from router.ops.scaling import SCALABLE_ROLES

if TYPE_CHECKING:  # types only: the sampler needs no grpc
    from router.routing.admission import AdmissionQueue
    from router.routing.cluster_backend import TransferTotals

logger = logging.getLogger(__name__)

WINDOW_S = 10.0
"""Each sample covers the last 10 s: rates and percentiles of one second would be mostly noise."""
STEP_TIMEOUT_S = 2.0
"""Longest one step may take (reading a snapshot is bounded by the reader's own timeout too)."""
COUNTERS = {"finished": "vllm:request_success_total", "prompt_tokens": "vllm:prompt_tokens_total",
            "generation_tokens": "vllm:generation_tokens_total"}
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds"}


class BackendCounters(Protocol):
    """What the sampler reads of router.routing.cluster_backend.ClusterBackend (read only)."""

    transfers: TransferTotals
    fallbacks: Counter[str]


class StateCounters(BackendCounters, Protocol):
    """... and what the state body reads besides."""

    admission: AdmissionQueue
    rejections: Counter[str]


def read_metrics(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, Buckets]]:
    """(counter totals by COUNTERS key, cumulative buckets by HISTOGRAMS key), summed over
    label sets (finish reasons)."""
    names = {*COUNTERS.values(), *(f"{h}_bucket" for h in HISTOGRAMS.values())}
    totals: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for metric in registry.restricted_registry(names).collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                buckets[s.name][float(s.labels["le"])] += s.value
            elif s.name in names:
                totals[s.name] += s.value
    counters = {key: totals.get(name, 0.0) for key, name in COUNTERS.items()}
    latency = {key: tuple(sorted(buckets[f"{name}_bucket"].items())) for key, name in HISTOGRAMS.items()}
    return counters, latency


def kv_usage(snapshot: ClusterSnapshot) -> dict[str, float]:
    """Role -> fraction of its workers' KV blocks in use (a role with no workers: absent)."""
    usage = {}
    for role in SCALABLE_ROLES:
        members = snapshot.members(role)  # type: ignore[arg-type]
        if members:
            usage[role] = float(role_totals(members)["kv_cache_usage_perc"])
    return usage


def take_reading(at_unix: float, registry: CollectorRegistry, backend: BackendCounters,
                 snapshot: ClusterSnapshot) -> Reading:
    counters, latency = read_metrics(registry)
    links = {f"{p}->{d}": (t.nbytes, t.seconds) for (p, d), t in backend.transfers.by_link.items()}
    return Reading(at_unix=at_unix, latency=latency, links=links, fallbacks=dict(backend.fallbacks),
                   kv_usage=kv_usage(snapshot), **counters)


class DashboardSampler:
    """Appends one sample per `interval_s` to `history` while started."""

    def __init__(self, history: History, registry: CollectorRegistry, backend: BackendCounters,
                 snapshot: Callable[[], Awaitable[ClusterSnapshot]], window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.history = history
        self._registry = registry
        self._backend = backend
        self._snapshot = snapshot
        self._clock = clock
        self._window: deque[Reading] = deque(maxlen=max(int(window_s / history.interval_s), 1) + 1)
        self._task: asyncio.Task | None = None
        self._failing = False

    async def step(self) -> None:
        """Read once and append the sample of the trailing window (the first step has no
        window yet: rates and latencies are null)."""
        snapshot = await self._snapshot()
        reading = take_reading(self._clock(), self._registry, self._backend, snapshot)
        self._window.append(reading)
        self.history.append(reading.at_unix, sample(self._window[0], reading))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dashboard-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        interval = self.history.interval_s
        next_at = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    await self.step()
                self._failing = False
            except Exception:  # a chart gap, never a dead sampler; logged once per outage
                if not self._failing:
                    logger.warning("dashboard samples skipped until the next good one", exc_info=True)
                self._failing = True
            next_at = max(next_at + interval, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())
