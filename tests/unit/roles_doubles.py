"""Doubles for the other side of the roles API's seams: a Scaler that records its calls, a
drain call that records the workers it was asked to drain, and fixed cluster snapshots."""

from __future__ import annotations

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.ops.roles import DrainOutcome, RolesApi
from router.ops.scaling import RoleScale

NOW = 1000.0
"""The roles API's clock in these tests (heartbeat ages are NOW - updated_at)."""


def worker(worker_id: str, role: str, state: str = "serving", updated_at: float = NOW - 0.25,
           incarnation: str = "inc-1", free_blocks: int = 100) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"10.0.0.1:{5000 + len(worker_id)}",  # type: ignore[arg-type]
                      metrics_address="", incarnation=incarnation, block_size=16, total_blocks=100,
                      free_blocks=free_blocks, reserved_blocks=0, cached_blocks=0, num_running=0,
                      num_waiting=0, queued_prefill_tokens=0, max_model_len=2048, updated_at=updated_at,
                      state=state)  # type: ignore[arg-type]


def snapshot(*workers: WorkerInfo) -> ClusterSnapshot:
    return ClusterSnapshot(workers=tuple(sorted(workers, key=lambda w: w.worker_id)), taken_at=0.0, stale=False)


CLUSTER = snapshot(worker("decode-0", "decode"), worker("decode-1", "decode", state="draining"),
                   worker("prefill-0", "prefill", updated_at=NOW - 1.5, incarnation="inc-7"))


class FakeScaler:
    """Records scale calls; `fail` makes every call raise it."""

    name = "fake"

    def __init__(self, desired: dict[str, int | None] | None = None, restarts: dict[str, int] | None = None,
                 fail: Exception | None = None) -> None:
        self.counts = dict(desired or {"prefill": 1, "decode": 2})
        self.restarts = dict(restarts or {"prefill": 0, "decode": 3})
        self.fail = fail
        self.calls: list[tuple[str, int]] = []

    async def desired(self) -> dict[str, RoleScale]:
        if self.fail is not None:
            raise self.fail
        return {r: RoleScale(r, self.counts.get(r), self.restarts.get(r, 0)) for r in ("prefill", "decode")}  # type: ignore[arg-type]

    async def scale(self, role, replicas: int) -> RoleScale:
        self.calls.append((role, replicas))
        if self.fail is not None:
            raise self.fail
        self.counts[role] = replicas
        return RoleScale(role, replicas, self.restarts.get(role, 0))


class RecordingDrain:
    def __init__(self) -> None:
        self.drained: list[str] = []

    async def __call__(self, w: WorkerInfo) -> DrainOutcome:
        self.drained.append(w.worker_id)
        return DrainOutcome(w.worker_id, started=True, in_flight=2)


def roles_api(scaler=None, drain=None, cluster: ClusterSnapshot = CLUSTER, max_replicas: int = 16) -> RolesApi:
    async def read() -> ClusterSnapshot:
        return cluster

    return RolesApi(read, scaler, drain, max_replicas=max_replicas, clock=lambda: NOW)

