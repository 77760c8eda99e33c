"""The router's reader of the workers' block-event stream, feeding its PrefixIndex.

Lifecycle: created -> start() (an asyncio task on the router's loop) -> reading -> aclose() ->
closed. The task rebuilds the index by reading `pdserve:{cluster}:kv_events` from the beginning
("0"; workers trim it to the last minute or so, and every live worker's latest snapshot is in
it), then follows it with blocking XREADs of at most block_ms each, applying every entry in
stream order. `caught_up` turns True once a read returns less than a full batch.

Stale workers: the index fences retired incarnations itself; the router calls
`prune(snapshot)` with its ClusterSnapshots so workers whose heartbeat expired are dropped, and
a heartbeat's newer incarnation replaces older entries (router/routing/prefix_index.py).

Redis down: the index is kept (routing goes on with what it knew), reads are retried with
exponential backoff, one warning per outage and one info when Redis is back; the task never
raises. After an outage, if the stream was reset (Redis restarted empty, or its last id is
behind ours), reading starts over from "0"; workers republish snapshots after an outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.cluster.keys import ClusterSnapshot, kv_events_key
from router.routing.policy import RouteRequest
from router.routing.prefix_index import BlockEvent, PrefixIndex, PromptHashes, as_prompt_hashes, route_request
from router.cluster.redis_settings import RedisAuth, async_client, redact_url

__all__ = ["KVEventReader"]

logger = logging.getLogger(__name__)


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class KVEventReader:
    """Follows one cluster's block-event stream into `index`. Use from one event loop; the
    index is only touched on it (no locks needed). Counters only grow, except lag_s."""

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        index: PrefixIndex | None = None,
        *,
        block_ms: int = 500,
        count: int = 1000,
        timeout_s: float = 1.0,
        backoff_min_s: float = 0.1,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        auth: RedisAuth | None = None,
    ) -> None:
        """block_ms: the longest one XREAD waits for new entries (bounds how long aclose and
        outage detection take). timeout_s: socket slack beyond block_ms. clock: wall clock,
        compared with entry ids (Redis's ms clock) for lag_s. auth: Redis credentials (None:
        the URL's, else the environment's; router/cluster/redis_settings.py)."""
        if block_ms < 1 or count < 1 or timeout_s <= 0 or not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError("block_ms, count >= 1; timeout_s > 0; 0 < backoff_min_s <= backoff_max_s")
        self.redis_url = redact_url(redis_url)
        self.key = kv_events_key(cluster)
        self.index = index if index is not None else PrefixIndex()
        self.block_ms = block_ms
        self.count = count
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._client: aredis.Redis = async_client(
            redis_url,
            auth,
            socket_timeout=block_ms / 1000 + timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._task: asyncio.Task[None] | None = None
        self.last_id: bytes = b"0"
        """Id of the last entry read; b"0" reads the stream from its beginning."""
        self.caught_up = False
        self._closing = False
        """True once a read returned less than a full batch (the replay at start is done)."""
        self.events_applied = 0
        """Entries applied to the index."""
        self.snapshot_events = 0
        """Of those, snapshot entries."""
        self.events_dropped = 0
        """Entries the index refused (retired incarnation, or no worker slot left)."""
        self.malformed = 0
        """Entries that did not parse (skipped)."""
        self.lag_s = 0.0
        """Age of the last entry applied when it was applied; 0.0 when a read found none."""
        self.consecutive_failures = 0
        """Reads failed in a row; 0 once one succeeds."""
        self.restarts = 0
        """Times reading started over from "0" after finding the stream reset."""

    @property
    def redis_ok(self) -> bool:
        return self.consecutive_failures == 0

    def start(self) -> asyncio.Task[None]:
        """Start following the stream on the running loop. Raises if started twice."""
        if self._task is not None:
            raise RuntimeError("KVEventReader already started")
        self._task = asyncio.get_running_loop().create_task(self.run(), name="pdserve-kv-events")
        return self._task

    async def run(self) -> None:
        """Read until cancelled or closed; never raises for Redis trouble or bad entries."""
        # The flag, not only the cancellation, ends the loop: a redis client cancelled inside a
        # blocking read can swallow the CancelledError, and the loop must still stop.
        while not self._closing:
            try:
                if self.consecutive_failures:
                    await self._restart_if_reset()
                await self.read_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — keep the index, retry with backoff
                self.consecutive_failures += 1
                if self.consecutive_failures == 1:
                    logger.warning(
                        "block events from Redis at %s unreadable (%s: %s); routing on the "
                        "prefix index as it was, retrying with backoff",
                        self.redis_url, type(exc).__name__, exc,
                    )  # fmt: skip
                await asyncio.sleep(self._backoff_s())
                continue
            if self.consecutive_failures:
                logger.info(
                    "block events from Redis at %s readable again after %d failed reads",
                    self.redis_url, self.consecutive_failures,
                )  # fmt: skip
                self.consecutive_failures = 0

    def _backoff_s(self) -> float:
        exponent = min(self.consecutive_failures - 1, 30)
        return min(self.backoff_max_s, self.backoff_min_s * 2**exponent)

    async def read_once(self) -> int:
        """One blocking XREAD after last_id; applies what it returns and returns how many
        entries it read. Raises Redis errors (run() handles them)."""
        reply = await self._client.xread({self.key: self.last_id}, count=self.count, block=self.block_ms)
        entries = self._entries(reply)
        for entry_id, fields in entries:
            self._apply(fields)
            self.last_id = entry_id
        if entries:
            self.lag_s = max(0.0, self._clock() - _id_key(self.last_id)[0] / 1000)
        else:
            self.lag_s = 0.0
        if len(entries) < self.count:
            self.caught_up = True
        return len(entries)

    def _entries(self, reply) -> Sequence[tuple[bytes, dict]]:
        # Our client speaks RESP2 (the default): [[key, [(id, fields), ...]]], or [] on timeout.
        return reply[0][1] if reply else []

    def _apply(self, fields: dict) -> None:
        try:
            event = BlockEvent.from_fields(fields)
        except ValueError as exc:
            self.malformed += 1
            logger.debug("skipping a malformed block event: %s", exc)
            return
        if self.index.apply(event):
            self.events_applied += 1
            self.snapshot_events += event.kind == "snapshot"
        else:
            self.events_dropped += 1

    async def _restart_if_reset(self) -> None:
        """After an outage: start over from "0" when the stream's newest id is behind ours
        (Redis came back empty and entries restart below our position, or it is gone)."""
        if self.last_id == b"0":
            return
        newest = await self._client.xrevrange(self.key, count=1)
        if not newest or _id_key(newest[0][0]) < _id_key(self.last_id):
            logger.info("block-event stream %s was reset; reading it from the beginning", self.key)
            self.last_id = b"0"
            self.restarts += 1

    def prune(self, snapshot: ClusterSnapshot) -> tuple[str, ...]:
        """Drop workers whose heartbeat expired and fence older incarnations (see
        PrefixIndex.prune); returns the worker ids dropped. Call with each new snapshot."""
        return self.index.prune(snapshot)

    def route_request(
        self, prompt_token_ids: Sequence[int] | PromptHashes, max_tokens: int | None, snapshot: ClusterSnapshot
    ) -> RouteRequest:
        """prune(snapshot), then the RouteRequest with each worker's cached leading blocks."""
        self.prune(snapshot)
        return route_request(prompt_token_ids, max_tokens, snapshot, self.index)

    def note_routed(self, worker_ids: Sequence[str], prompt_token_ids: Sequence[int] | PromptHashes,
                    snapshot: ClusterSnapshot) -> None:
        """Expect these workers to hold the prompt's full blocks soon: a request was just sent
        there. Requests with the same prefix that arrive before the workers' own events then
        follow it (an optimistic entry; the workers' evictions and snapshots correct it). The
        prompt is hashed once per block size (not again where route_request's PromptHashes
        hashed it)."""
        prompt = as_prompt_hashes(prompt_token_ids)
        for worker_id in worker_ids:
            info = snapshot.by_id(worker_id)
            if info is None:
                continue
            hashes = prompt.all(info.block_size)
            if hashes:
                self.index.apply(BlockEvent(worker_id, info.incarnation, "stored", hashes))

    CLOSE_TIMEOUT_S = 2.0
    """Bound on each shutdown step: a Redis client cancelled mid-read must not hang shutdown."""

    async def aclose(self) -> None:
        """Stop the task (if started) and close the client, each within CLOSE_TIMEOUT_S.
        Idempotent; never raises for a task or client that will not stop in time."""
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=self.CLOSE_TIMEOUT_S)
            if not done:
                logger.warning("block-event reader did not stop within %g s", self.CLOSE_TIMEOUT_S)
        try:
            await asyncio.wait_for(self._client.aclose(), self.CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError) as exc:
            logger.info("closing the block-event reader's Redis client: %s", type(exc).__name__)
