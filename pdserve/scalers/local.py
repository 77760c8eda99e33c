"""`local`: the router's Scaler for a cluster run by `pdserve up` (local processes).

It talks to the supervisor only through Redis: scale() writes a signed desired count
(desired_state.py), which the supervisor reconciles to within ~0.5 s; desired() reads the
counts back with the supervisor's status hash. No status hash (it has a 5 s TTL, refreshed
every loop) means no supervisor is alive: ScalerUnavailable, so a scale request is refused
rather than recorded for nobody. A supervisor of another kind (the status hash's `kind`: a
`pdserve up --launcher ray` when this router was told `--scaler local`) is refused the same way.

SupervisorScaler is that mechanism for any launcher whose supervisor is `pdserve up`'s
reconcile loop; pdserve/scalers/ray.py is the other one.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.scalers.desired_state import DesiredCount, decode_desired, text_map
from router.cluster.keys import desired_replicas_key, scaler_status_key
from router.ops.scaling import SCALABLE_ROLES, RoleScale, ScaleError, ScalerUnavailable

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 2.0
"""Bound of each Redis round trip (the Scaler protocol's calls are bounded)."""


class SupervisorScaler:
    """Scaler over Redis for a `pdserve up` supervisor of kind `name`. One per router; async,
    not thread-safe (one event loop)."""

    name = "local"
    launcher = "pdserve up"
    """How that supervisor is started, for the 503 that says none runs."""

    def __init__(self, redis_url: str | None, cluster: str, secret: bytes | None) -> None:
        if not redis_url:
            raise ValueError(f"the {self.name} scaler needs --redis-url (the supervisor reads desired counts there)")
        if not secret:
            raise ValueError(f"the {self.name} scaler needs the cluster secret (it signs desired counts)")
        from router.cluster.redis_settings import async_client  # credentials: from the environment

        self._redis = async_client(redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                   socket_connect_timeout=REDIS_TIMEOUT_S)
        self._cluster, self._secret = cluster, secret

    async def desired(self) -> dict[str, RoleScale]:
        """Per role: the verified desired count (None when absent or unsigned) and the
        supervisor's restart count. Raises ScalerUnavailable (no supervisor, Redis down)."""
        desired, status = await self._read()
        return {role: RoleScale(role, self._verified(role, desired.get(role)), _restarts(status, role))
                for role in SCALABLE_ROLES}

    async def scale(self, role: str, replicas: int) -> RoleScale:
        """Record the desired count (signed) for the supervisor. Raises ScaleError (unknown
        role, count not an int >= 0), ScalerUnavailable (no supervisor, Redis down)."""
        if role not in SCALABLE_ROLES:
            raise ScaleError(f"unknown role {role!r}; roles: {', '.join(SCALABLE_ROLES)}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ScaleError(f"replicas must be an integer >= 0; got {replicas!r}")
        _, status = await self._read()
        value = DesiredCount.now(role, replicas).encode(self._cluster, self._secret)
        await self._bounded(self._redis.hset(desired_replicas_key(self._cluster), role, value))
        logger.info("desired %s replicas set to %d", role, replicas)
        return RoleScale(role, replicas, _restarts(status, role))  # type: ignore[arg-type]

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _read(self) -> tuple[dict[str, str], dict[str, str]]:
        async def both():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(desired_replicas_key(self._cluster))
                pipe.hgetall(scaler_status_key(self._cluster))
                return await pipe.execute()

        desired, status = await self._bounded(both())
        if not status:
            raise ScalerUnavailable(f"no {self.launcher} supervisor is running for cluster {self._cluster!r} "
                                    "(its status in Redis is absent or expired)")
        status = text_map(status)
        if status.get("kind", "local") != self.name:
            raise ScalerUnavailable(f"cluster {self._cluster!r} is supervised by a {status.get('kind')!r} launcher, "
                                    f"not {self.name!r}: start the router with --scaler {status.get('kind')}")
        return text_map(desired), status

    async def _bounded(self, call):
        from redis.exceptions import RedisError

        try:
            return await asyncio.wait_for(call, REDIS_TIMEOUT_S + 1)
        except (asyncio.TimeoutError, OSError, RedisError) as exc:
            raise ScalerUnavailable(f"cannot reach Redis for the scaler's state: {exc or 'timed out'}") from None

    def _verified(self, role: str, value: str | None) -> int | None:
        if value is None:
            return None
        try:
            return decode_desired(role, value, self._cluster, self._secret).replicas
        except ValueError as exc:
            logger.warning("ignoring the %s entry in Redis: %s", role, exc)
            return None


class LocalScaler(SupervisorScaler):
    """`pdserve up` with local processes (pdserve/launchers/local.py)."""

    name = "local"
    launcher = "pdserve up"


def _restarts(status: dict[str, str], role: str) -> int:
    try:
        return int(status.get(f"restarts:{role}", "0"))
    except ValueError:
        return 0
