"""Bridges to workers that predate the `Worker` protocol (no status() / drain() yet).

TEMPORARY: once PrefillWorker and DecodeWorker implement status(), begin_drain() and drain()
(worker_runtime/status.py), delete the fallbacks here and call the methods directly. Everything
else in worker_runtime goes through `status_of` and `drain_of`, so this file is the only place
that reads a worker's attributes.
"""

from __future__ import annotations

import asyncio
import time

from worker_runtime.status import DrainResult, TransferTotals, WorkerState, WorkerStatus

__all__ = ["drain_of", "status_of"]

_POLL_S = 0.05


def status_of(worker, role: str) -> WorkerStatus:
    """worker.status() when the worker has it; otherwise the same frozen status built from
    its loop's stats snapshot and transfer counters (state: SERVING; `role` is the role the
    process registered it as)."""
    status = getattr(worker, "status", None)
    if callable(status):
        return status()
    s = worker.loop.stats
    queued_sends = len(getattr(worker, "_in_flight", ()))  # a prefill's transfers not yet settled
    return WorkerStatus(
        worker_id=worker.worker_id, incarnation=worker.incarnation, role=role,
        state=WorkerState.SERVING, block_size=worker.core.config.block_size,
        max_model_len=worker.core.max_model_len, core=s,
        in_flight=s.num_running + s.num_waiting + s.num_reserved + s.num_swapped + queued_sends,
        transfers=TransferTotals(worker.transfers, worker.transfer_bytes, worker.transfer_seconds,
                                 getattr(worker, "transfer_failures", 0)),
    )


async def drain_of(worker, role: str, timeout_s: float) -> DrainResult:
    """await worker.drain(timeout_s) when the worker has it. Otherwise wait (polling, at most
    timeout_s) until its status shows nothing in flight; what is still in flight then is
    reported as aborted (the process's stop ends those calls with CANCELLED)."""
    drain = getattr(worker, "drain", None)
    if callable(drain):
        return await drain(timeout_s)
    start = time.monotonic()
    initial = status_of(worker, role).in_flight
    deadline = start + timeout_s
    while (left := status_of(worker, role).in_flight) and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    return DrainResult(finished=max(initial - left, 0), aborted=left, seconds=time.monotonic() - start)
