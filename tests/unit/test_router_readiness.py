"""/ready and readiness: not ready while a role the cluster needs has no worker."""

from __future__ import annotations

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.api.http import HttpSettings, create_app
from router.cluster.readiness import Readiness, readiness
from tests.unit.router_doubles import ScriptedBackend, call, make_service, token_steps


def worker(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:1", metrics_address="",
                      incarnation="i1", block_size=16, total_blocks=100, free_blocks=100,
                      reserved_blocks=0, cached_blocks=0, num_running=0, num_waiting=0,
                      queued_prefill_tokens=0, max_model_len=2048, updated_at=1.0)


def snapshot(*workers: WorkerInfo, stale: bool = False) -> ClusterSnapshot:
    return ClusterSnapshot(workers=workers, taken_at=0.0, stale=stale)


def test_a_disaggregated_cluster_needs_both_roles():
    assert readiness(snapshot(worker("p0", "prefill"), worker("d0", "decode")), True) == Readiness(
        True, "ready", 1, 1)
    assert readiness(snapshot(worker("d0", "decode")), True) == Readiness(
        False, "not ready: no prefill worker is registered", 0, 1)
    assert readiness(snapshot(), True) == Readiness(
        False, "not ready: no decode worker is registered and no prefill worker is registered", 0, 0)


def test_a_colocated_cluster_needs_only_decode_workers():
    assert readiness(snapshot(worker("d0", "decode")), False) == Readiness(True, "ready", 0, 1)
    assert readiness(snapshot(worker("p0", "prefill")), False) == Readiness(
        False, "not ready: no decode worker is registered", 1, 0)


def test_a_worker_of_role_both_counts_for_each_role():
    assert readiness(snapshot(worker("b0", "both")), True) == Readiness(True, "ready", 1, 1)


def test_not_ready_on_a_stale_snapshot_says_so():
    assert readiness(snapshot(stale=True), False).reason == (
        "not ready: no decode worker is registered (cluster state could not be read; last known state)")


def app_with(state: Readiness, api_key: str | None = "k"):
    async def check() -> Readiness:
        return state

    service = make_service(ScriptedBackend(token_steps([1])))
    return create_app(service, HttpSettings(api_key=api_key, readiness=check))


def test_ready_is_a_503_with_the_reason_and_open_without_the_key():
    response = call(app_with(Readiness(False, "not ready: no decode worker is registered", 1, 0)), "GET", "/ready")
    assert response.status_code == 503
    assert response.json() == {"error": {"message": "not ready: no decode worker is registered",
                                          "type": "ServiceUnavailableError", "param": None, "code": 503}}
    assert response.headers["retry-after"] == "1"


def test_ready_is_200_with_worker_counts_when_ready_and_health_stays_200_either_way():
    ready = app_with(Readiness(True, "ready", 1, 2))
    assert call(ready, "GET", "/ready").json() == {"status": "ready", "prefill_workers": 1, "decode_workers": 2}
    assert call(app_with(Readiness(False, "x", 0, 0)), "GET", "/health").status_code == 200


def test_pdserve_up_tells_its_router_whether_the_cluster_is_colocated():
    from pdserve.cli import build_parser
    from pdserve.specs import RouterSpec

    parser = build_parser()
    for up_flags, colocated in ((["--colocated"], True), ([], False)):
        up = parser.parse_args(["up", *up_flags])
        router = parser.parse_args(RouterSpec.from_args(up).to_argv())
        assert router.colocated is colocated
