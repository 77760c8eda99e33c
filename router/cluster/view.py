"""The service-wide view of the cluster, from the router's snapshot: totals per role and one
entry per worker (replica). Served as JSON on /v1/cluster and as gauges on /metrics.

Pure: builds plain values from a ClusterSnapshot; no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from router.cluster.keys import ClusterSnapshot, WorkerInfo

__all__ = ["role_totals", "worker_entry", "cluster_body"]

_SUMMED = ("total_blocks", "free_blocks", "reserved_blocks", "cached_blocks", "num_running",
           "num_waiting", "queued_prefill_tokens")


def role_totals(workers: Iterable[WorkerInfo]) -> dict[str, int | float]:
    """Sums over the workers of one role, plus token capacity and usage."""
    workers = list(workers)
    totals: dict[str, int | float] = {name: sum(getattr(w, name) for w in workers) for name in _SUMMED}
    totals["workers"] = len(workers)
    totals["capacity_tokens"] = sum(w.total_blocks * w.block_size for w in workers)
    totals["free_tokens"] = sum(max(w.free_blocks - w.reserved_blocks, 0) * w.block_size for w in workers)
    total = totals["total_blocks"]
    totals["kv_cache_usage_perc"] = (1 - totals["free_blocks"] / total) if total else 0.0
    return totals


def worker_entry(w: WorkerInfo, now: float) -> dict[str, object]:
    entry: dict[str, object] = {
        "worker_id": w.worker_id, "role": w.role, "address": w.address,
        "metrics_address": w.metrics_address, "incarnation": w.incarnation, "state": w.state,
        "block_size": w.block_size, "max_model_len": w.max_model_len,
    }
    entry.update({name: getattr(w, name) for name in _SUMMED})
    entry["capacity_tokens"] = w.total_blocks * w.block_size
    entry["kv_cache_usage_perc"] = 1 - w.free_blocks / w.total_blocks if w.total_blocks else 0.0
    entry["heartbeat_age_s"] = round(max(now - w.updated_at, 0.0), 3)
    return entry


def cluster_body(cluster: str, snapshot: ClusterSnapshot, redis_ok: bool, policy: str,
                 queue: dict[str, object], now: float | None = None) -> dict[str, object]:
    """The JSON body of /v1/cluster."""
    now = time.time() if now is None else now
    return {
        "cluster": cluster,
        "policy": policy,
        "redis_ok": redis_ok,
        "stale": snapshot.stale,
        # KV held by a draining worker is still held: totals count every member of the role.
        "decode": role_totals(snapshot.members("decode")),
        "prefill": role_totals(snapshot.members("prefill")),
        "admission_queue": queue,
        "workers": [worker_entry(w, now) for w in snapshot.workers],
    }
