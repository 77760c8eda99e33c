"""A worker's periodic stats line (router/serving/stats_log.py has the text and the "only when changed"
rule), read from its frozen WorkerStatus on a daemon thread.

Lifecycle: created (the start-up state taken as the first sample) -> start() -> a line every
interval_s when it changed -> stop() (thread joined, bounded). interval_s 0: never started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.serving.stats_log import StatsSample, StatsTicker

if TYPE_CHECKING:  # worker_runtime.status imports the engine (torch)
    from worker_runtime.status import WorkerStatus

__all__ = ["WorkerStatsLog", "worker_sample"]

logger = logging.getLogger(__name__)


def worker_sample(status: WorkerStatus, now: float) -> StatsSample:
    """The stats of one worker: its engine's counters and gauges, its KV transfers (sent by a
    prefill worker, received by a decode worker)."""
    s, t = status.core, status.transfers
    usage = (s.total_blocks - s.free_blocks) / s.total_blocks if s.total_blocks else 0.0
    return StatsSample(taken_at=now, prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
                       prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                       transfers=t.count, transfer_bytes=t.nbytes, running=s.num_running, waiting=s.num_waiting,
                       kv_usage=(("", usage),))


class WorkerStatsLog:
    """Logs `status()`'s stats line every interval_s while it changes. status must be callable
    from any thread (WorkerProcess.status is)."""

    def __init__(self, status: Callable[[], WorkerStatus], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0; got {interval_s}")
        self._status = status
        self._clock = clock
        self.interval_s = interval_s
        self._ticker = StatsTicker(worker_sample(status(), clock()))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> str | None:
        """Take a sample now; log and return its line, or None when it repeats the last one."""
        line = self._ticker.tick(worker_sample(self._status(), self._clock()))
        if line is None:
            return None
        logger.info("%s", line[0], extra={"stats": line[1]})
        return line[0]

    def start(self) -> None:
        """Start the daemon thread (not blocking). Raises if started twice."""
        if self._thread is not None:
            raise RuntimeError("WorkerStatsLog already started")
        self._thread = threading.Thread(target=self._run, name="pdserve-stats-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 — a stats line must never stop the worker
                logger.debug("stats line skipped", exc_info=True)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, waiting at most timeout_s. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
