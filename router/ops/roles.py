"""The roles API's behaviour, shared by HTTP (router.ops.admin_http) and gRPC (admin_grpc).

Per scalable role it joins two truths: what the scaler wants (desired replicas, restarts —
Kubernetes' Scale `spec`) and what the cluster snapshot shows (ready = serving, draining —
its `status`). Scaling only records a desired count; the scaler's controller reconciles, so
the answer to a scale is the role's status at once, not after the workers come up (200, as
Kubernetes answers a PUT on a Scale subresource). Scaler and worker failures become
RouterErrors here, so both protocols map them in their one place. No grpc import: the drain
call is injected (router.ops.drain_call builds the real one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.errors import Conflict, InvalidRequest, NotFound, RouterError, Unavailable
from router.ops.scaling import SCALABLE_ROLES, RoleScale, Scaler, ScaleError, ScalerUnavailable

DEFAULT_MAX_REPLICAS = 16
SCALER_TIMEOUT_S = 5.0
"""Longest wait for the scaler (which bounds its own calls too): a hung controller answers 503."""
NO_SCALER = ("This router has no scaler (--scaler none), so nothing would act on a desired count: "
             "the role's workers are started and stopped outside pdserve. Start the router with "
             "--scaler local, ray or kubernetes (pdserve up and the Helm chart do) to scale from here.")


@dataclass(frozen=True)
class WorkerEntry:
    worker_id: str
    address: str
    """gRPC host:port."""
    state: str
    """"serving" or "draining" (only those write heartbeats)."""
    incarnation: str
    heartbeat_age_s: float
    """Seconds since its last heartbeat (the router's clock minus the worker's)."""


@dataclass(frozen=True)
class RoleStatus:
    role: str
    desired: int | None
    """From the scaler; None when no scaler manages the cluster."""
    ready: int
    """Serving workers of the role (routers send them work)."""
    draining: int
    """Workers finishing their in-flight requests before they exit (no new work)."""
    restarts: int
    """Crashed workers the scaler's controller restarted (0 without a scaler)."""
    workers: tuple[WorkerEntry, ...]
    """Every live worker of the role, sorted by id."""


@dataclass(frozen=True)
class RolesView:
    roles: tuple[RoleStatus, ...]
    """One per scalable role, in SCALABLE_ROLES order."""
    scaler: str | None
    """The scaler's name, or None when the router has none."""


@dataclass(frozen=True)
class DrainOutcome:
    """A worker's answer to Drain (it returns at once; the worker exits later)."""

    worker_id: str
    started: bool
    """False when it was already draining (the first call's timeout holds)."""
    in_flight: int
    """Requests in flight on it when the call arrived."""


DrainCall = Callable[[WorkerInfo], Awaitable[DrainOutcome]]


def check_role(role: str) -> str:
    """`role` when it is scalable; NotFound listing the roles otherwise."""
    if role not in SCALABLE_ROLES:
        raise NotFound(f"Unknown role {role!r}; the roles are: {', '.join(SCALABLE_ROLES)}.", param="role")
    return role


def check_replicas(value: object, max_replicas: int) -> int:
    """`value` as a replica count, or InvalidRequest saying what is wrong with it. A JSON
    `true` or `2.0` is refused: a count is an integer, as in a Kubernetes Scale object."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"replicas must be an integer; got {value!r}", param="replicas")
    if value < 0:
        raise InvalidRequest(f"replicas must be >= 0; got {value}", param="replicas")
    if value > max_replicas:
        raise InvalidRequest(f"replicas must be <= {max_replicas} (--max-replicas); got {value}", param="replicas")
    return value


def role_status(role: str, snapshot: ClusterSnapshot, scale: RoleScale | None, now: float) -> RoleStatus:
    """The role's status from the snapshot (workers) and the scaler's view (desired, restarts)."""
    members = snapshot.members(role)  # type: ignore[arg-type]
    entries = tuple(WorkerEntry(w.worker_id, w.address, w.state, w.incarnation,
                                round(max(now - w.updated_at, 0.0), 3)) for w in members)
    return RoleStatus(
        role=role,
        desired=None if scale is None else scale.desired,
        ready=sum(1 for w in members if w.state == "serving"),
        draining=sum(1 for w in members if w.draining),
        restarts=0 if scale is None else scale.restarts,
        workers=entries,
    )


class RolesApi:
    """Reads and scales the roles, drains workers. `last` is the latest view (for /metrics)."""

    def __init__(self, snapshot: Callable[[], Awaitable[ClusterSnapshot]], scaler: Scaler | None = None,
                 drain_call: DrainCall | None = None, max_replicas: int = DEFAULT_MAX_REPLICAS,
                 clock: Callable[[], float] = time.time) -> None:
        if max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1; got {max_replicas}")
        self._snapshot = snapshot
        self.scaler = scaler
        self._drain_call = drain_call
        self.max_replicas = max_replicas
        self._clock = clock
        self.last: RolesView | None = None

    async def roles(self) -> RolesView:
        """Every scalable role's status. Raises Unavailable when the scaler cannot be read."""
        scales = await self._desired() if self.scaler is not None else {}
        snapshot = await self._snapshot()
        now = self._clock()
        view = RolesView(tuple(role_status(r, snapshot, scales.get(r), now) for r in SCALABLE_ROLES),
                         None if self.scaler is None else self.scaler.name)
        self.last = view
        return view

    async def role(self, role: str) -> RoleStatus:
        check_role(role)
        return next(r for r in (await self.roles()).roles if r.role == role)

    async def scale(self, role: str, replicas: object) -> RoleStatus:
        """Record the role's desired count and answer its status. Raises NotFound (role),
        InvalidRequest (count, or the scaler's ScaleError), Conflict (no scaler), Unavailable."""
        check_role(role)
        count = check_replicas(replicas, self.max_replicas)
        if self.scaler is None:
            raise Conflict(NO_SCALER)
        scale = await self._scaler_call(self.scaler.scale(role, count))  # type: ignore[arg-type]
        return role_status(role, await self._snapshot(), scale, self._clock())

    async def drain(self, worker_id: str) -> DrainOutcome:
        """Ask one worker to drain. Raises NotFound for an id no live worker has, Conflict when
        this router cannot call workers, the drain call's WorkerFailure."""
        worker = (await self._snapshot()).by_id(worker_id)
        if worker is None:
            raise NotFound(f"No live worker has id {worker_id!r}.", param="worker_id")
        if self._drain_call is None:
            raise Conflict("This router cannot call workers (no drain call configured).")
        return await self._drain_call(worker)

    async def refresh(self) -> None:
        """Update `last` for a metrics scrape; a failure keeps the previous view."""
        try:
            await self.roles()
        except RouterError:  # a scrape must not fail for the scaler's sake
            pass

    async def _desired(self) -> dict[str, RoleScale]:
        assert self.scaler is not None, "callers check for a scaler first"
        return await self._scaler_call(self.scaler.desired())

    async def _scaler_call(self, call):
        """The one place scaler errors become RouterErrors."""
        try:
            async with asyncio.timeout(SCALER_TIMEOUT_S):
                return await call
        except ScaleError as exc:
            raise InvalidRequest(str(exc), param="replicas") from None
        except ScalerUnavailable as exc:
            raise Unavailable(f"The scaler {self.scaler.name!r} is unavailable: {exc}") from None  # type: ignore[union-attr]
        except TimeoutError:
            raise Unavailable(f"The scaler {self.scaler.name!r} did not answer within "  # type: ignore[union-attr]
                              f"{SCALER_TIMEOUT_S:g} s.") from None
