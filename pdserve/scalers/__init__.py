"""Scalers: what records a role's desired replica count for its controller to reconcile.

One typed registry, SCALERS (name -> Scaler class, imported lazily), so the router's
`--scaler NAME` and any other caller build a scaler the same way (`make_scaler`). Every
class takes (redis_url, cluster, secret) and implements router.ops.scaling.Scaler.

    local       the `pdserve up` supervisor (pdserve/launchers/local.py), through Redis
    ray         the `pdserve up --launcher ray` supervisor (pdserve/launchers/ray/), through Redis
    kubernetes  the Helm chart's Deployments, through their Scale subresource (needs the
                `pdserve[kubernetes]` extra: lightkube)
"""

from __future__ import annotations

from engine.registry import Registry

__all__ = ["SCALERS", "make_scaler"]

SCALERS: Registry[type] = Registry("scaler")
SCALERS.register("local", "pdserve.scalers.local:LocalScaler")
SCALERS.register("ray", "pdserve.scalers.ray:RayScaler")
SCALERS.register("kubernetes", "pdserve.scalers.kubernetes:KubernetesScaler")


def make_scaler(name: str, redis_url: str | None, cluster: str, secret: bytes | None):
    """A new scaler by registry name. Raises KeyError listing the known names when unknown,
    ValueError when the scaler cannot work with these settings (e.g. no Redis)."""
    return SCALERS.get(name)(redis_url, cluster, secret)
