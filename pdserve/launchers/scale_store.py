"""The supervisor's side of the local scaler's Redis state (pdserve/scalers/desired_state.py):
read the signed desired counts, publish its status. Synchronous, every call bounded by the
client's socket timeout, so a Redis that is down delays one loop by at most ~1 s and the
supervisor keeps its last desired counts."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pdserve.scalers.desired_state import STATUS_TTL_S, DesiredCount, decode_desired, text_map
from router.cluster.keys import desired_replicas_key, scaler_status_key
from router.ops.scaling import SCALABLE_ROLES
from router.cluster.redis_settings import RedisAuth

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 1.0


class ScaleStore:
    """Desired counts in, status out. Keeps the last verified count per role; a record that
    does not verify, is older than the last one taken, or asks for more than max_replicas is
    ignored (logged once per distinct value)."""

    def __init__(self, redis_url: str, cluster: str, secret: bytes, max_replicas: int,
                 auth: RedisAuth | None = None) -> None:
        """auth: the credentials (the embedded Redis's password); None: from the environment."""
        from router.cluster.redis_settings import sync_client

        self._redis = sync_client(redis_url, auth, socket_timeout=REDIS_TIMEOUT_S,
                                  socket_connect_timeout=REDIS_TIMEOUT_S)
        self._cluster, self._secret, self._max = cluster, secret, max_replicas
        self._current: dict[str, DesiredCount] = {}
        self._rejected: set[str] = set()
        self._redis_ok = True

    @property
    def desired(self) -> dict[str, int]:
        return {role: c.replicas for role, c in self._current.items()}

    def set_initial(self, counts: Mapping[str, int]) -> None:
        """This run's starting counts (--prefill, --decode), written over any left in Redis."""
        self._current = {role: DesiredCount.now(role, n) for role, n in counts.items()}
        self._write(self._current.values())

    def read(self) -> dict[str, int]:
        """The desired counts to reconcile to: Redis's verified newer records, else the last
        ones. A role missing from Redis (the embedded Redis restarted empty) is written back."""
        raw = self._call(lambda: self._redis.hgetall(desired_replicas_key(self._cluster)))
        if raw is None:
            return self.desired
        text = text_map(raw)
        for role in SCALABLE_ROLES:
            if role in text:
                self._take(role, text[role])
        missing = [c for role, c in self._current.items() if role not in text]
        if missing:
            self._write(missing)
        return self.desired

    def publish_status(self, fields: Mapping[str, str]) -> None:
        key = scaler_status_key(self._cluster)

        def write():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping=dict(fields))
            pipe.pexpire(key, int(STATUS_TTL_S * 1000))
            pipe.execute()
            return True

        self._call(write)

    def clear_status(self) -> None:
        """At exit: no supervisor any more (scalers answer unavailable at once, not in 5 s)."""
        self._call(lambda: self._redis.delete(scaler_status_key(self._cluster)))

    def close(self) -> None:
        self._redis.close()

    def _take(self, role: str, value: str) -> None:
        try:
            count = decode_desired(role, value, self._cluster, self._secret)
        except ValueError as exc:
            self._reject(value, str(exc))
            return
        current = self._current.get(role)
        if current is not None and count.seq <= current.seq:
            if count.seq < current.seq:
                self._reject(value, f"{role}: a desired count older than the one in force")
            return
        if count.replicas > self._max:
            self._reject(value, f"{role}: {count.replicas} replicas is above --max-replicas {self._max}")
            return
        logger.info("desired %s replicas: %d", role, count.replicas)
        self._current[role] = count

    def _reject(self, value: str, why: str) -> None:
        if value not in self._rejected:
            self._rejected.add(value)
            logger.warning("ignoring a desired count in Redis: %s", why)

    def _write(self, counts) -> None:
        mapping = {c.role: c.encode(self._cluster, self._secret) for c in counts}
        if mapping:
            self._call(lambda: self._redis.hset(desired_replicas_key(self._cluster), mapping=mapping))

    def _call(self, fn):
        from redis.exceptions import RedisError

        try:
            result = fn()
        except (RedisError, OSError) as exc:
            if self._redis_ok:
                logger.warning("Redis unreachable for the scaler's state (%s); keeping the last desired counts", exc)
            self._redis_ok = False
            return None
        if not self._redis_ok:
            logger.info("Redis reachable again for the scaler's state")
        self._redis_ok = True
        return result
