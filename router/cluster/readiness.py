"""Whether the router can serve a request now: the truth behind /ready and gRPC health.

/health is the process's liveness (it answers while the router runs); readiness asks whether
a request sent now has workers to go to. Pure: decided from a ClusterSnapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from router.cluster.keys import ClusterSnapshot


@dataclass(frozen=True)
class Readiness:
    """The router's readiness and, when not ready, why."""

    ready: bool
    reason: str
    """One line for operators: what is missing, or "ready"."""
    prefill_workers: int
    decode_workers: int


def readiness(snapshot: ClusterSnapshot, needs_prefill: bool) -> Readiness:
    """Ready when a decode worker is serving, and (in a disaggregated cluster, `needs_prefill`)
    a prefill worker too. Draining workers take no new work, so they do not count. A colocated
    cluster's decode workers prefill their own prompts."""
    prefill, decode = len(snapshot.prefill_workers()), len(snapshot.decode_workers())
    missing = []
    if decode == 0:
        missing.append(_missing(snapshot, "decode"))
    if needs_prefill and prefill == 0:
        missing.append(_missing(snapshot, "prefill"))
    if missing:
        stale = " (cluster state could not be read; last known state)" if snapshot.stale else ""
        return Readiness(False, "not ready: " + " and ".join(missing) + stale, prefill, decode)
    return Readiness(True, "ready", prefill, decode)


def _missing(snapshot: ClusterSnapshot, role: Literal["prefill", "decode"]) -> str:
    draining = sum(1 for w in snapshot.members(role) if w.draining)
    if draining:
        return f"no {role} worker is serving ({draining} draining)"
    return f"no {role} worker is registered"
