"""The scaler interface the router's roles API drives (one truth for scaling).

A scaler has Kubernetes' Scale-subresource shape per role: the desired replicas a person or
an autoscaler asked for, the ready ones, the draining ones. `scale(role, n)` only records the
desired count; the scaler's controller (the `pdserve up` supervisor, the Kubernetes Deployment
controller, the Ray launcher) reconciles to it, draining what it removes. So an autoscaler and
a person never fight over process lists: the last desired count wins.

Implementations live in pdserve/scalers (registry `SCALERS`); the router gets one injected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

ScalableRole = Literal["prefill", "decode"]
SCALABLE_ROLES: tuple[str, ...] = get_args(ScalableRole)


class ScaleError(ValueError):
    """A scale request that cannot be carried out as asked (the message says why); 400."""


class ScalerUnavailable(RuntimeError):
    """The scaler's controller cannot be reached (e.g. no supervisor running); 503."""


@dataclass(frozen=True)
class RoleScale:
    role: ScalableRole
    desired: int | None
    """None: nobody manages this role's count (workers started by hand)."""
    restarts: int = 0
    """Crashed workers restarted since the controller started."""


class Scaler(Protocol):
    name: str
    """"local", "kubernetes", "ray"."""

    async def desired(self) -> dict[str, RoleScale]:
        """Per scalable role, the desired count and restarts. Reads the controller's state;
        bounded by a timeout; raises ScalerUnavailable when it cannot be read."""

    async def scale(self, role: ScalableRole, replicas: int) -> RoleScale:
        """Record `replicas` as the role's desired count and return the new RoleScale.
        Does not wait for workers. Raises ScaleError (bad role or count), ScalerUnavailable."""
