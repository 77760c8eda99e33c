"""A worker's prefix-cache block events into the cluster's Redis stream, for routers' prefix index.

Lifecycle: created (a snapshot wanted) -> start() -> publishing -> stop() -> stopped (an empty snapshot written,
best effort, so routers forget the worker's blocks at once; thread joined).

Two threads, one queue between them:
- the engine loop thread calls `poll()` (register it with `ServingLoop.add_poll_hook`) every
  iteration. It takes the core's block events and appends them to the queue; when a snapshot is
  wanted it takes the core's cached hashes instead, and that snapshot replaces everything
  queued before it (it supersedes those events). poll() never touches Redis and never blocks
  beyond a short lock.
- a daemon thread drains the queue into XADDs on `pdserve:{cluster}:kv_events` (one pipeline
  per batch, MAXLEN ~ maxlen, and after each snapshot an XTRIM MINID ~ of entries older than
  retention_s). It asks for a snapshot at start, every snapshot_interval_s, after Redis comes
  back from an outage, and when Redis's run_id changes (a restart the worker never saw fail).

Redis being down never hurts the worker: the first failure is logged (once per outage, and
once when Redis is back), the queue is dropped, poll() discards events until Redis answers
again, and then a snapshot replaces what was lost. Memory is bounded: past max_queued_hashes
queued hashes the queue is dropped and a snapshot is asked for instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.kv_cache.block_pool import BlockEvents
from engine.kv_cache.hashing import BlockHash
from router.cluster.keys import kv_events_key
from router.routing.prefix_index import BlockEvent, EventKind
from router.cluster.redis_settings import RedisAuth, redact_url, sync_client

__all__ = ["KVEventPublisher", "order_events"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    kind: EventKind
    hashes: tuple[BlockHash, ...]


def order_events(
    events: BlockEvents, cached_hashes: Callable[[], Sequence[BlockHash]]
) -> tuple[tuple[BlockHash, ...], tuple[BlockHash, ...]]:
    """(evicted, stored) to publish in that order. BlockEvents loses the order between its
    two lists, so a hash in both is resolved by the cache's state now (cached_hashes is called
    only then): cached -> it ends stored, else it ends evicted."""
    both = set(events.stored) & set(events.evicted)
    if not both:
        return events.evicted, events.stored
    cached = set(cached_hashes())
    evicted = tuple(h for h in events.evicted if h not in both or h not in cached)
    stored = tuple(h for h in events.stored if h not in both or h in cached)
    return evicted, stored


class KVEventPublisher:
    """Publishes one worker's block events. `take_events` and `cached_hashes` are the core's
    (EngineCore.take_block_events / cached_block_hashes) and are called only from poll(), on
    the engine loop thread. Counters are read from any thread."""

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        worker_id: str,
        incarnation: str,
        take_events: Callable[[], BlockEvents],
        cached_hashes: Callable[[], Sequence[BlockHash]],
        *,
        snapshot_interval_s: float = 10.0,
        retention_s: float = 60.0,
        maxlen: int = 200_000,
        max_hashes_per_entry: int = 4096,
        max_queued_hashes: int = 1 << 18,
        retry_interval_s: float = 0.5,
        check_interval_s: float = 1.0,
        auth: RedisAuth | None = None,
    ) -> None:
        """retention_s: stream entries older than this (by their Redis id) are trimmed after
        each snapshot; it must cover two snapshot intervals so a router replaying the stream
        finds every live worker's latest snapshot. check_interval_s: how often Redis's run_id
        is compared (detects a restart when no write failed). auth: Redis credentials (None:
        the URL's, else the environment's; router/cluster/redis_settings.py)."""
        if snapshot_interval_s <= 0 or retry_interval_s <= 0 or check_interval_s <= 0:
            raise ValueError("snapshot, retry and check intervals must be > 0")
        if retention_s < 2 * snapshot_interval_s:
            raise ValueError(
                f"retention_s ({retention_s}) must be >= 2 * snapshot_interval_s "
                f"({snapshot_interval_s}), or replays could miss a worker's latest snapshot"
            )
        if maxlen < 1 or max_hashes_per_entry < 1 or max_queued_hashes < 1:
            raise ValueError("maxlen, max_hashes_per_entry and max_queued_hashes must be >= 1")
        self.redis_url = redact_url(redis_url)
        self.key = kv_events_key(cluster)
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.snapshot_interval_s = snapshot_interval_s
        self.retention_ms = int(retention_s * 1000)
        self.maxlen = maxlen
        self.max_hashes_per_entry = max_hashes_per_entry
        self.max_queued_hashes = max_queued_hashes
        self.retry_interval_s = retry_interval_s
        self.check_interval_s = check_interval_s
        self._take_events = take_events
        self._cached_hashes = cached_hashes
        # Our loop retries on its own schedule, so the client must neither retry nor block long.
        self._client = sync_client(
            redis_url, auth, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._queued_hashes = 0
        self._want_snapshot = threading.Event()
        self._want_snapshot.set()  # the first poll() takes a snapshot: it opens the stream for us
        self._stop = threading.Event()
        self._down = False
        self._run_id: str | None = None
        self._thread: threading.Thread | None = None
        self.entries = 0
        """Stream entries written."""
        self.snapshots = 0
        """Snapshots written (a snapshot may span several entries)."""
        self.failures = 0
        """Writes or probes that failed."""
        self.dropped_hashes = 0
        """Hashes discarded (Redis down, queue over its bound, superseded by a snapshot)."""

    @property
    def redis_ok(self) -> bool:
        """False from a failed write until Redis answers again."""
        return not self._down

    # ------------------------------------------------------------------ engine loop thread
    def poll(self) -> None:
        """The engine loop's hook: hand the core's block events (or a snapshot) to the queue.
        Loop thread only; never blocks on Redis; raises only what the core's calls raise."""
        events = self._take_events()
        if self._want_snapshot.is_set() and not self._stop.is_set():
            self._want_snapshot.clear()
            self._enqueue_snapshot(tuple(self._cached_hashes()))
            return
        if not events.stored and not events.evicted:
            return
        evicted, stored = order_events(events, self._cached_hashes)
        with self._cond:
            if self._down or self._stop.is_set():
                self.dropped_hashes += len(evicted) + len(stored)
                return
            if self._queued_hashes + len(evicted) + len(stored) > self.max_queued_hashes:
                self.dropped_hashes += self._queued_hashes + len(evicted) + len(stored)
                self._clear_queue_locked()
                self._want_snapshot.set()  # the snapshot on the next poll replaces them
                return
            for kind, hashes in (("evicted", evicted), ("stored", stored)):
                if hashes:
                    self._queue.append(_Item(kind, hashes))  # type: ignore[arg-type]
                    self._queued_hashes += len(hashes)
            self._cond.notify()

    def _enqueue_snapshot(self, hashes: tuple[BlockHash, ...]) -> None:
        with self._cond:
            self.dropped_hashes += self._queued_hashes
            self._clear_queue_locked()
            self._queue.append(_Item("snapshot", hashes))
            self._queued_hashes = len(hashes)
            self._cond.notify()

    def _clear_queue_locked(self) -> None:
        self._queue.clear()
        self._queued_hashes = 0

    # ------------------------------------------------------------------ publisher thread
    def request_snapshot(self) -> None:
        """Ask for a full snapshot; the next poll() takes it. Thread-safe, non-blocking."""
        self._want_snapshot.set()

    def start(self) -> None:
        """Start the daemon thread (the snapshot asked for at construction goes first). Does not
        block. Raises if started twice."""
        if self._thread is not None:
            raise RuntimeError("KVEventPublisher already started")
        self._thread = threading.Thread(
            target=self._run, name=f"pdserve-kv-events-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        now = time.monotonic()
        next_snapshot, next_check = now + self.snapshot_interval_s, now
        while not self._stop.is_set():
            if self._down:
                if not self._stop.wait(self.retry_interval_s):
                    self._probe()
                continue
            now = time.monotonic()
            if now >= next_snapshot:
                self.request_snapshot()
                next_snapshot = now + self.snapshot_interval_s
            if now >= next_check:
                self._check_run_id()
                next_check = now + self.check_interval_s
            batch = self._take_batch(timeout_s=min(next_snapshot, next_check) - now)
            if batch:
                self._publish(batch)

    def _take_batch(self, timeout_s: float) -> list[_Item]:
        with self._cond:
            if not self._queue and not self._stop.is_set():
                self._cond.wait(max(timeout_s, 0.0))
            batch = list(self._queue)
            self._clear_queue_locked()
            return batch

    def _entries(self, batch: list[_Item]) -> list[BlockEvent]:
        """The batch as stream entries: adjacent items of one kind merged, at most
        max_hashes_per_entry hashes each; a snapshot's later chunks are `stored`."""
        merged: list[_Item] = []
        for item in batch:
            if merged and item.kind == merged[-1].kind != "snapshot":
                merged[-1] = _Item(item.kind, merged[-1].hashes + item.hashes)
            else:
                merged.append(item)
        entries = []
        step = self.max_hashes_per_entry
        for item in merged:
            for start in range(0, max(len(item.hashes), 1), step):
                kind = "stored" if item.kind == "snapshot" and start else item.kind
                chunk = item.hashes[start : start + step]
                entries.append(BlockEvent(self.worker_id, self.incarnation, kind, chunk))
        return entries

    def _publish(self, batch: list[_Item]) -> bool:
        entries = self._entries(batch)
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.xadd(self.key, entry.to_fields(), maxlen=self.maxlen, approximate=True)
                ids = pipe.execute()
            snapshot_ids = [i for i, e in zip(ids, entries) if e.kind == "snapshot"]
            if snapshot_ids:
                self._trim_before(snapshot_ids[-1])
        except Exception as exc:  # noqa: BLE001 — Redis trouble must never kill the worker
            self._fail(exc, dropped=sum(len(item.hashes) for item in batch))
            return False
        self.entries += len(entries)
        self.snapshots += sum(item.kind == "snapshot" for item in batch)
        return True

    def _trim_before(self, entry_id: bytes | str) -> None:
        text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        # Entry ids are Redis's clock in ms, so retention does not depend on ours.
        min_ms = int(text.split("-")[0]) - self.retention_ms
        if min_ms > 0:
            self._client.xtrim(self.key, minid=f"{min_ms}-0", approximate=True)

    def _fail(self, exc: Exception, dropped: int) -> None:
        self.failures += 1
        with self._cond:
            self.dropped_hashes += dropped + self._queued_hashes
            self._clear_queue_locked()
            was_down, self._down = self._down, True
        if not was_down:
            logger.warning(
                "block events to Redis at %s failed (%s: %s); the worker keeps serving, drops "
                "events while Redis is down and publishes a snapshot when it is back",
                self.redis_url,
                type(exc).__name__,
                exc,
            )

    def _probe(self) -> None:
        try:
            self._run_id = self._read_run_id()
        except Exception as exc:  # noqa: BLE001
            self.failures += 1
            logger.debug("Redis at %s still unreachable: %s", self.redis_url, exc)
            return
        logger.info("block events to Redis at %s work again; publishing a snapshot", self.redis_url)
        self.request_snapshot()  # before _down clears, so no event slips in ahead of it
        with self._cond:
            self._down = False

    def _check_run_id(self) -> None:
        try:
            run_id = self._read_run_id()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, dropped=0)
            return
        if self._run_id is not None and run_id != self._run_id:
            logger.info("Redis at %s restarted (new run_id); publishing a snapshot", self.redis_url)
            self.request_snapshot()
        self._run_id = run_id

    def _read_run_id(self) -> str:
        return str(self._client.info("server")["run_id"])

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop publishing, join the thread (at most timeout_s), write an empty snapshot (best
        effort: this worker's blocks are going away), close the client. Idempotent. poll()
        keeps draining the core's events afterwards, so a still-running loop holds none."""
        self._stop.set()
        with self._cond:
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("block events thread did not stop within %g s", timeout_s)
            self._thread = None
            self._publish_goodbye()
        self._client.close()

    def _publish_goodbye(self) -> None:
        # An empty snapshot: routers forget our blocks now rather than when our heartbeat
        # expires. Best effort; when Redis is down the expiry does the same, later.
        if self._down:
            return
        goodbye = BlockEvent(self.worker_id, self.incarnation, "snapshot", ())
        try:
            self._client.xadd(self.key, goodbye.to_fields(), maxlen=self.maxlen, approximate=True)
        except Exception as exc:  # noqa: BLE001
            logger.info("could not publish the final empty snapshot: %s", exc)
            return
        self.entries += 1
        self.snapshots += 1
