"""The router's view of the cluster: snapshots of the workers' heartbeats in Redis.

A snapshot is read at most once per max_age_s (DESIGN.md: cached <= 100 ms) and shared by the
requests routed meanwhile. Reading: SMEMBERS of the workers set, then every worker's hash in one
pipeline. Ids whose hash has expired are removed from the set; hashes that do not parse are
skipped; an entry from an older incarnation of a worker than one already seen is fenced off.

Given the cluster secret, the reader takes only entries whose signature verifies
(router/cluster_keys.verified_info): an entry written by anyone else with access to Redis is
skipped, counted in `rejected_entries`, and logged once per worker id. Without a secret
(library use, tests) every entry that parses is taken.

When Redis cannot be read the reader keeps answering with its last good snapshot marked
stale=True (routing goes on with load that is a little old), logs one warning per outage and
one info when Redis is back, and counts consecutive failures for a metric.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router.cluster.keys import (
    ClusterSnapshot,
    UnsignedEntry,
    WorkerInfo,
    verified_info,
    worker_key,
    workers_set_key,
)
from router.cluster.redis_settings import RedisAuth, async_client, redact_url

__all__ = ["ClusterSnapshot", "ClusterStateReader", "Fence", "fence_incarnations"]

logger = logging.getLogger(__name__)

Fence = Mapping[str, tuple[str, float]]
"""worker_id -> (incarnation, updated_at) of the newest entry seen for it."""

# Removes set members whose hash is gone, atomically, so a worker that re-registers between
# our read and this removal keeps its place in the set.
# KEYS[1] workers set, KEYS[2..] worker hashes; ARGV[i] the worker id of KEYS[i + 1].
_REMOVE_EXPIRED = """
local removed = 0
for i, worker_id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], worker_id)
  end
end
return removed
"""


def fence_incarnations(
    entries: Iterable[WorkerInfo], fence: Fence
) -> tuple[tuple[WorkerInfo, ...], dict[str, tuple[str, float]]]:
    """Keep one entry per worker id, the newest by updated_at, and drop any entry whose
    incarnation differs from the fenced one while being no newer than it.

    Pure: returns (kept entries sorted by worker_id, the updated fence); mutates nothing.
    """
    newest: dict[str, WorkerInfo] = {}
    for entry in entries:
        held = newest.get(entry.worker_id)
        if held is None or entry.updated_at > held.updated_at:
            newest[entry.worker_id] = entry
    new_fence = dict(fence)
    kept = []
    for worker_id in sorted(newest):
        entry = newest[worker_id]
        seen = fence.get(worker_id)
        if seen is not None and entry.incarnation != seen[0] and entry.updated_at <= seen[1]:
            continue  # a previous run's late write: the newer incarnation owns this id
        new_fence[worker_id] = (entry.incarnation, entry.updated_at)
        kept.append(entry)
    return tuple(kept), new_fence


def _member_text(member: bytes | str) -> str | None:
    if isinstance(member, str):
        return member
    try:
        return member.decode("utf-8")
    except UnicodeDecodeError:
        logger.debug("skipping a workers-set member that is not UTF-8: %r", member)
        return None


class ClusterStateReader:
    """Reads ClusterSnapshots from Redis for one cluster; or serves a static list without Redis.

    Use from one event loop (the redis.asyncio client binds to it). `snapshot()` never raises
    for Redis trouble. Call `aclose()` on shutdown.
    """

    def __init__(
        self,
        redis_url: str | None,
        cluster: str,
        max_age_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        static_workers: Sequence[WorkerInfo] = (),
        retry_interval_s: float = 0.5,
        timeout_s: float = 0.5,
        *,
        secret: bytes | None = None,
        auth: RedisAuth | None = None,
    ) -> None:
        """redis_url None: every snapshot holds static_workers (ignored when a URL is given).
        retry_interval_s: while Redis is failing, the least time between two reads, so routing
        does not wait on a dead Redis at every request. timeout_s: bound on one read.
        secret: the cluster secret; entries not signed with it are ignored (None: no check).
        auth: Redis credentials (None: the URL's, else the environment's)."""
        self.redis_url = redact_url(redis_url) if redis_url is not None else None
        self._url = redis_url
        self._secret = secret
        self._auth = auth
        self.rejected_entries = 0
        """Heartbeat entries skipped because their signature was missing or wrong."""
        self._rejected_ids: set[str] = set()
        self.cluster = cluster
        self.max_age_s = max_age_s
        self.retry_interval_s = max(retry_interval_s, max_age_s)
        self.timeout_s = timeout_s
        self._clock = clock
        self._set_key = workers_set_key(cluster)
        self._client: aredis.Redis | None = None
        self._lock: asyncio.Lock | None = None
        self._fence: dict[str, tuple[str, float]] = {}
        self._parsed: dict[str, tuple[dict, WorkerInfo]] = {}
        """Each worker's heartbeat hash as last read, and what it verified and parsed to: a
        read finding the same bytes (heartbeats are seconds apart, reads 0.1 s) reuses it."""
        self._last: ClusterSnapshot | None = None
        self._last_try: float | None = None
        self._redis_ok = True
        self._consecutive_failures = 0
        if redis_url is None:
            workers, _ = fence_incarnations(static_workers, {})
            self._last = ClusterSnapshot(workers=workers, taken_at=clock(), stale=False)

    @property
    def redis_ok(self) -> bool:
        """False from a failed read until the next read that succeeds (True without Redis)."""
        return self._redis_ok

    @property
    def consecutive_failures(self) -> int:
        """Reads failed in a row; 0 once one succeeds."""
        return self._consecutive_failures

    @property
    def last_snapshot(self) -> ClusterSnapshot | None:
        """The snapshot most recently read (or served stale), without reading Redis."""
        return self._last

    async def snapshot(self) -> ClusterSnapshot:
        """The current snapshot, read from Redis if the cached one is older than max_age_s.

        Concurrent callers share one read. Never raises for Redis errors: returns the last good
        snapshot with stale=True (an empty one if none was ever read).
        """
        if self.redis_url is None:
            assert self._last is not None, "a static reader builds its snapshot at construction"
            return self._last
        if self._fresh_enough():
            assert self._last is not None, "_fresh_enough implies a snapshot"
            return self._last
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._fresh_enough():  # another caller may have read while we waited
                await self._refresh()
        assert self._last is not None, "_refresh always leaves a snapshot"
        return self._last

    def _fresh_enough(self) -> bool:
        if self._last is None or self._last_try is None:
            return False
        wait_s = self.max_age_s if self._redis_ok else self.retry_interval_s
        return self._clock() - self._last_try < wait_s

    async def _refresh(self) -> None:
        self._last_try = self._clock()
        try:
            entries = await asyncio.wait_for(self._read(), self.timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._on_failure(exc)
            return
        workers, self._fence = fence_incarnations(entries, self._fence)
        self._last = ClusterSnapshot(workers=workers, taken_at=self._last_try, stale=False)
        if not self._redis_ok:
            logger.info(
                "Redis at %s is readable again after %d failed reads; %d workers",
                self.redis_url,
                self._consecutive_failures,
                len(workers),
            )
        self._redis_ok = True
        self._consecutive_failures = 0

    def _on_failure(self, exc: BaseException) -> None:
        self._consecutive_failures += 1
        if self._redis_ok:
            logger.warning(
                "cannot read cluster state from Redis at %s (%s: %s); routing on the last "
                "snapshot until it is back",
                self.redis_url,
                type(exc).__name__,
                exc,
            )
        self._redis_ok = False
        last = self._last or ClusterSnapshot(workers=(), taken_at=self._clock(), stale=True)
        self._last = ClusterSnapshot(workers=last.workers, taken_at=last.taken_at, stale=True)

    async def _read(self) -> list[WorkerInfo]:
        client = self._get_client()
        members = await client.smembers(self._set_key)
        worker_ids = sorted(filter(None, map(_member_text, members)))
        if not worker_ids:
            return []
        keys = [worker_key(self.cluster, worker_id) for worker_id in worker_ids]
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            hashes = await pipe.execute()
        entries, expired = [], []
        parsed: dict[str, tuple[dict, WorkerInfo]] = {}
        for worker_id, key, data in zip(worker_ids, keys, hashes):
            if not data:
                expired.append((worker_id, key))
                continue
            seen = self._parsed.get(worker_id)
            if seen is not None and seen[0] == data:  # the same bytes verify and parse the same
                parsed[worker_id] = seen
                entries.append(seen[1])
                continue
            try:
                info = verified_info(data, self.cluster, self._secret)
            except UnsignedEntry as exc:
                self._on_unsigned(worker_id, exc)
                continue
            except ValueError as exc:
                logger.debug("skipping unreadable heartbeat %s: %s", key, exc)
                continue
            if info.worker_id != worker_id:
                logger.debug("skipping %s: it names worker %r", key, info.worker_id)
                continue
            parsed[worker_id] = (data, info)
            entries.append(info)
        self._parsed = parsed
        if expired:
            await client.eval(
                _REMOVE_EXPIRED,
                1 + len(expired),
                self._set_key,
                *(key for _, key in expired),
                *(worker_id for worker_id, _ in expired),
            )
            for worker_id, _ in expired:
                self._fence.pop(worker_id, None)
        return entries

    def _on_unsigned(self, worker_id: str, exc: UnsignedEntry) -> None:
        self.rejected_entries += 1
        if worker_id not in self._rejected_ids and len(self._rejected_ids) < 10_000:
            self._rejected_ids.add(worker_id)  # bounded: a flood of fake ids cannot grow it
            logger.warning(
                "ignoring the heartbeat entry of worker %r in Redis: %s (not written by a "
                "worker holding this cluster's secret)",
                worker_id,
                exc,
            )

    def _get_client(self) -> aredis.Redis:
        if self._client is None:
            assert self._url is not None, "only a Redis-backed reader makes a client"
            # No client-side retries: a failed read falls back to the last snapshot at once.
            self._client = async_client(
                self._url,
                self._auth,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        return self._client

    async def aclose(self) -> None:
        """Close the Redis connections. The reader must not be used afterwards."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
