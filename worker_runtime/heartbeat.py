"""A worker's heartbeat into the cluster state (Redis), on a daemon thread.

Lifecycle: created -> start() -> beating (one write now, then every interval_s) -> stop() ->
stopped (its hash deleted when it is still ours, thread joined). Each beat replaces the worker's
hash with `info()` and gives it a TTL of ttl_s, and adds the worker id to the workers set, in
one MULTI/EXEC: a reader never sees half a heartbeat, and after Redis restarts empty the next
beat registers the worker again.

With the cluster secret the hash is signed (router/cluster_keys.signed_hash), so routers that
hold the secret can tell it from an entry written by anyone else with access to Redis.

`heartbeat_info` turns a worker's frozen WorkerStatus into the WorkerInfo a beat writes, so the
heartbeat reads the worker only through status(). Beats are serialized (one lock), so a beat
taken after the worker turned DRAINING is never overwritten by an older "serving" one: a drain
calls beat() itself to publish the state at once.

Redis being down never stops the worker: a failed beat is logged once per outage (and once
when Redis is back) and retried at the next interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from router.cluster.keys import WorkerInfo, signed_hash, worker_key, workers_set_key
from router.cluster.redis_settings import RedisAuth, redact_url, sync_client

if TYPE_CHECKING:  # worker_runtime.status imports the engine (torch); a publisher needs neither
    from worker_runtime.status import WorkerStatus

__all__ = ["HeartbeatPublisher", "heartbeat_info"]

logger = logging.getLogger(__name__)

# Deletes the worker's hash only when it still holds our incarnation: a stopping old process
# must not unregister the new incarnation that replaced it.
# KEYS[1] worker hash, KEYS[2] workers set; ARGV[1] incarnation, ARGV[2] worker id.
_UNREGISTER = """
if redis.call('HGET', KEYS[1], 'incarnation') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


def heartbeat_info(status: WorkerStatus, address: str, metrics_address: str, link_address: str = "") -> WorkerInfo:
    """The heartbeat of a worker whose status is `status`, serving gRPC on `address` (and its
    worker link on `link_address`, "" for none).
    A DRAINING worker is published as "draining" (routers choose it no more); any other
    state as "serving" (a heartbeat is written only while the worker is registered)."""
    s = status.core
    return WorkerInfo(
        worker_id=status.worker_id, role=status.role, address=address, metrics_address=metrics_address,
        incarnation=status.incarnation, block_size=status.block_size, total_blocks=s.total_blocks,
        free_blocks=s.free_blocks, reserved_blocks=s.reserved_blocks, cached_blocks=s.cached_blocks,
        num_running=s.num_running, num_waiting=s.num_waiting, queued_prefill_tokens=s.queued_prefill_tokens,
        max_model_len=status.max_model_len, updated_at=time.time(),
        state="draining" if status.state.value == "draining" else "serving",  # WorkerState.DRAINING
        prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
        prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
        prefill_busy_s=s.prefill_busy_s, decode_busy_s=s.decode_busy_s, link_address=link_address,
    )


class HeartbeatPublisher:
    """Publishes `info()` to Redis every interval_s until stop(). One per worker process.

    `info` is called on the publisher's thread, so it must be thread-safe (return a fresh
    frozen WorkerInfo built from counters the engine updates). Its worker_id must not change.
    """

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        info: Callable[[], WorkerInfo],
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
        *,
        secret: bytes | None = None,
        auth: RedisAuth | None = None,
    ) -> None:
        """secret: the cluster secret that signs each beat (None: unsigned, which a router
        holding a secret ignores). auth: Redis credentials (None: the URL's, else the
        environment's; router/cluster/redis_settings.py)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0; got {interval_s}")
        if ttl_s <= interval_s:
            raise ValueError(
                f"ttl_s ({ttl_s}) must exceed interval_s ({interval_s}), or a live worker's "
                "entry would expire between beats"
            )
        self.redis_url = redact_url(redis_url)
        self.cluster = cluster
        self.interval_s = interval_s
        self._secret = secret
        self.ttl_s = ttl_s
        self._info = info
        # Our own loop retries each interval, so the client must not retry (or block) longer.
        timeout_s = min(interval_s, 1.0)
        self._client = sync_client(
            redis_url,
            auth,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._stop = threading.Event()
        self._first_attempt = threading.Event()
        self._beat_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last: WorkerInfo | None = None
        self._ok = True
        self.beats = 0
        """Heartbeats written successfully."""
        self.failures = 0
        """Heartbeats that failed (Redis unreachable, or info() raised)."""

    @property
    def redis_ok(self) -> bool:
        """False from a failed beat until the next one that succeeds."""
        return self._ok

    def start(self) -> None:
        """Start the daemon thread; it beats at once. Does not block. Raises if started twice."""
        if self._thread is not None:
            raise RuntimeError("HeartbeatPublisher already started")
        self._thread = threading.Thread(
            target=self._run, name=f"pdserve-heartbeat-{self.cluster}", daemon=True
        )
        self._thread.start()

    def wait_first_beat(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until the thread's first beat was tried; whether it was
        written. A worker announces itself ready after this, so whoever waits for that finds it
        registered, not registered a moment later."""
        return self._first_attempt.wait(timeout_s) and self.beats > 0

    def _run(self) -> None:
        while True:
            self.beat()
            self._first_attempt.set()
            if self._stop.wait(self.interval_s):
                return

    def beat(self) -> bool:
        """Write one heartbeat now (any thread; waits for a beat in progress, each at most the
        client's socket timeout). Never raises; returns whether it was written (never after
        stop(): a late beat must not register again the worker that stop() unregistered)."""
        with self._beat_lock:
            return not self._stop.is_set() and self._beat()

    def _beat(self) -> bool:
        try:
            info = self._info()
            key = worker_key(self.cluster, info.worker_id)
            with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(key)  # drop fields an older version of the hash may still hold
                fields = info.to_hash() if self._secret is None else signed_hash(info, self.cluster, self._secret)
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, int(self.ttl_s * 1000))
                pipe.sadd(workers_set_key(self.cluster), info.worker_id)
                pipe.execute()
        except Exception as exc:  # noqa: BLE001 — a heartbeat must never kill the worker
            self.failures += 1
            if self._ok:
                logger.warning(
                    "heartbeat to Redis at %s failed (%s: %s); the worker keeps serving and "
                    "retries every %g s",
                    self.redis_url,
                    type(exc).__name__,
                    exc,
                    self.interval_s,
                )
            self._ok = False
            return False
        if not self._ok:
            logger.info("heartbeat to Redis at %s works again", self.redis_url)
        self._ok = True
        self._last = info
        self.beats += 1
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating, join the thread (at most timeout_s), and delete our hash if it still
        holds our incarnation (best effort: errors are logged, not raised). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("heartbeat thread did not stop within %g s", timeout_s)
        with self._beat_lock:  # a beat in progress on another thread finishes first
            last, self._last = self._last, None
        if last is not None:
            try:
                self._client.eval(
                    _UNREGISTER,
                    2,
                    worker_key(self.cluster, last.worker_id),
                    workers_set_key(self.cluster),
                    last.incarnation,
                    last.worker_id,
                )
            except redis.RedisError as exc:
                logger.info("could not unregister %s from Redis: %s", last.worker_id, exc)
        self._client.close()

    def __enter__(self) -> HeartbeatPublisher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
