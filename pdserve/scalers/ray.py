"""`ray`: the router's Scaler for a cluster run by `pdserve up --launcher ray`.

The controller is the same reconcile loop as with local processes (pdserve/launchers/
supervisor.py), running in the `pdserve up --launcher ray` driver; what it reconciles are Ray
actors (pdserve/launchers/ray/). So the scaler is the same record as `local`'s: a signed desired
count in Redis, which the driver turns into actors created (placed by Ray on a node with the
role's resources) or drained and then removed. The router, itself an actor, needs no Ray
client for that, and a desired count outlives a router restart. The status hash must say
kind "ray", or the request is refused with a 503 naming the launcher that does run.
"""

from __future__ import annotations

from pdserve.scalers.local import SupervisorScaler


class RayScaler(SupervisorScaler):
    name = "ray"
    launcher = "pdserve up --launcher ray"
