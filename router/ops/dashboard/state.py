"""The body of GET /v1/dashboard/state: the cluster as an operator thinks of it, right now.

Per scalable role: the scaler's desired count and the ready / draining workers (the roles API's
one truth), whether a change is still pending, capacity in the FastDeploy FAQ's terms (blocks x
block size = tokens, and the concurrency that gives at the mean prompt + output length of the
last `mean_over` requests, or at max_model_len before any), and every worker with its KV blocks
split into the four parts of its bar. Then the admission queue, rejections by reason, path
fallbacks and KV transfers per prefill -> decode link.

Reads only: the roles API, the cluster snapshot, the backend's counters and the timeline ring.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.cluster.view import worker_entry
from router.errors import RouterError
from router.ops.dashboard.sampler import StateCounters
from router.ops.roles import RoleStatus, RolesApi, RolesView, role_status
from router.ops.scaling import SCALABLE_ROLES
from router.ops.timeline import TimelineStore

MEAN_OVER = 100
"""Requests the mean length is taken over (the issue's N)."""


@dataclass(frozen=True)
class DashboardSettings:
    """What the page shows about this router (fixed at start)."""

    cluster: str
    """The cluster name (Redis key prefix)."""
    model: str
    """The served model name."""
    max_model_len: int
    """The length capacity is computed at before any request has finished."""
    policy: str
    """The routing policy's name."""
    mean_over: int = MEAN_OVER
    """Requests the mean (prompt + output) length is taken over."""

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.mean_over < 1:
            raise ValueError(f"mean_over must be >= 1, got {self.mean_over}")


@dataclass(frozen=True)
class MeanLength:
    tokens: float
    """Prompt + output tokens of a typical request."""
    requests: int
    """Requests it is the mean of (0: it is max_model_len)."""
    basis: str


def mean_length(timelines: TimelineStore | None, n: int, max_model_len: int) -> MeanLength:
    """The mean prompt + output tokens of the last `n` requests that counted any tokens; or
    max_model_len (the worst case every request may reach) when there are none yet."""
    recent = timelines.recent(n) if timelines is not None else []
    lengths = [t.prompt_tokens + t.completion_tokens for t in recent]
    lengths = [n_tokens for n_tokens in lengths if n_tokens > 0]
    if not lengths:
        return MeanLength(float(max_model_len), 0, "max_model_len (no finished request yet)")
    count = len(lengths)
    return MeanLength(sum(lengths) / count, count,
                      f"mean prompt + output of the last {count} request{'s' if count > 1 else ''}")


def kv_bar(w: WorkerInfo) -> dict[str, int]:
    """The worker's blocks in four parts that add up to total_blocks: used (held by running
    requests), reserved (promised to admitted requests whose KV has not arrived; the worker
    still counts them free), cached (free, holding a reusable prefix) and free (the rest)."""
    free = max(min(w.free_blocks, w.total_blocks), 0)
    reserved = min(w.reserved_blocks, free)
    cached = min(w.cached_blocks, free - reserved)
    return {"used": w.total_blocks - free, "reserved": reserved, "cached": cached,
            "free": free - reserved - cached}


def role_capacity(members: Iterable[WorkerInfo], mean: MeanLength) -> dict[str, object]:
    """blocks x block size = tokens, and the requests of the mean length that fit (all of the
    role's KV, and what is free of it now)."""
    members = list(members)
    blocks = sum(w.total_blocks for w in members)
    tokens = sum(w.total_blocks * w.block_size for w in members)
    free_tokens = sum(max(w.free_blocks - w.reserved_blocks, 0) * w.block_size for w in members)
    sizes = sorted({w.block_size for w in members})
    concurrency = int(tokens // mean.tokens)
    size_text = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes)) or "0"
    return {
        "blocks": blocks, "block_size": sizes[0] if len(sizes) == 1 else None, "tokens": tokens,
        "free_tokens": free_tokens, "mean_request_tokens": round(mean.tokens, 1),
        "concurrency": concurrency, "free_concurrency": int(free_tokens // mean.tokens),
        "formula": f"{blocks} blocks x {size_text} tokens = {tokens} tokens; "
                   f"/ {mean.tokens:.0f} tokens per request = {concurrency} requests",
    }


def pending(status: RoleStatus) -> str | None:
    """What the role still has to do to reach its desired count (None: settled or unmanaged)."""
    if status.desired is None:
        return None
    steps = []
    if status.desired > status.ready:
        steps.append(f"{status.desired - status.ready} starting")
    if status.ready > status.desired:
        steps.append(f"{status.ready - status.desired} to remove")
    if status.draining:
        steps.append(f"{status.draining} draining")
    return ", ".join(steps) or None


def worker_body(w: WorkerInfo, now: float) -> dict[str, object]:
    return {**worker_entry(w, now), "kv_bar": kv_bar(w)}


def role_body(status: RoleStatus, snapshot: ClusterSnapshot, mean: MeanLength, now: float) -> dict[str, object]:
    members = snapshot.members(status.role)  # type: ignore[arg-type]
    return {
        "role": status.role, "desired": status.desired, "ready": status.ready,
        "draining": status.draining, "restarts": status.restarts, "pending": pending(status),
        "capacity": role_capacity(members, mean),
        "workers": [worker_body(w, now) for w in members],
    }


def transfers_body(backend: StateCounters) -> dict[str, object]:
    t = backend.transfers
    links = [{"prefill_id": p, "decode_id": d, "count": link.count, "nbytes": link.nbytes,
              "seconds": round(link.seconds, 6),
              "gbps": round(link.nbytes / link.seconds / 1e9, 4) if link.seconds > 0 else None}
             for (p, d), link in sorted(t.by_link.items())]
    return {"count": t.count, "nbytes": t.nbytes, "seconds": round(t.seconds, 6), "links": links}


def admission_body(backend: StateCounters) -> dict[str, object]:
    queue = backend.admission
    return {"waiting": queue.num_waiting, "max_queued": queue.settings.max_queued,
            "max_wait_s": queue.settings.max_wait_s, "blocks_waiting": queue.blocks_waiting(),
            "rejections": dict(queue.rejections) | dict(backend.rejections)}


class DashboardState:
    """Builds the state body; holds nothing between calls."""

    def __init__(self, settings: DashboardSettings, roles: RolesApi,
                 snapshot: Callable[[], Awaitable[ClusterSnapshot]], backend: StateCounters,
                 timelines: TimelineStore | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._roles = roles
        self._snapshot = snapshot
        self._backend = backend
        self._timelines = timelines
        self._clock = clock

    async def body(self) -> dict[str, object]:
        view, scaler_error = await self._roles_view()
        snapshot = await self._snapshot()
        now = self._clock()
        s = self.settings
        mean = mean_length(self._timelines, s.mean_over, s.max_model_len)
        return {
            "now_unix": round(now, 3), "cluster": s.cluster, "model": s.model, "policy": s.policy,
            "max_model_len": s.max_model_len, "stale": snapshot.stale,
            "scaler": view.scaler, "scaler_error": scaler_error,
            "mean_length": {"tokens": round(mean.tokens, 1), "requests": mean.requests, "basis": mean.basis},
            "roles": [role_body(r, snapshot, mean, now) for r in view.roles],
            "admission": admission_body(self._backend),
            "fallbacks": dict(self._backend.fallbacks),
            "transfers": transfers_body(self._backend),
        }

    async def _roles_view(self) -> tuple[RolesView, str | None]:
        """The roles API's view; when its scaler cannot be read, the workers alone (desired
        unknown) and why."""
        try:
            return await self._roles.roles(), None
        except RouterError as exc:
            snapshot, now = await self._snapshot(), self._clock()
            scaler = self._roles.scaler.name if self._roles.scaler is not None else None
            roles = tuple(role_status(r, snapshot, None, now) for r in SCALABLE_ROLES)
            return RolesView(roles, scaler), exc.message
