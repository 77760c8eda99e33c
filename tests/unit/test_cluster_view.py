"""The router's own view of the cluster: /v1/cluster totals, the route header, and its own
in-flight prefill load folded into the snapshot the policy sees."""

from __future__ import annotations

from router.serving.backend import RouteInfo
from router.routing.cluster_backend import ClusterBackend
from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.cluster.view import cluster_body, role_totals


def worker(worker_id: str, role: str, total: int, free: int, reserved: int = 0, cached: int = 0,
           queued: int = 0, running: int = 0, block_size: int = 16) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{len(worker_id)}",
                      metrics_address="", incarnation="inc", block_size=block_size, total_blocks=total,
                      free_blocks=free, reserved_blocks=reserved, cached_blocks=cached,
                      num_running=running, num_waiting=0, queued_prefill_tokens=queued,
                      max_model_len=2048, updated_at=100.0)


SNAPSHOT = ClusterSnapshot(
    workers=(worker("d0", "decode", 100, 40, reserved=10, cached=5, running=3),
             worker("d1", "decode", 60, 60, block_size=32),
             worker("p0", "prefill", 50, 50, queued=700)),
    taken_at=0.0, stale=False)


def test_role_totals_sum_blocks_and_count_tokens_in_each_workers_block_size():
    totals = role_totals(SNAPSHOT.decode_workers())
    assert totals == {
        "total_blocks": 160, "free_blocks": 100, "reserved_blocks": 10, "cached_blocks": 5,
        "num_running": 3, "num_waiting": 0, "queued_prefill_tokens": 0, "workers": 2,
        "capacity_tokens": 100 * 16 + 60 * 32, "free_tokens": 30 * 16 + 60 * 32,
        "kv_cache_usage_perc": 1 - 100 / 160,
    }


def test_cluster_body_lists_every_worker_with_its_heartbeat_age():
    body = cluster_body("c", SNAPSHOT, True, "cache_aware", {"waiting": 0}, now=101.5)
    assert [w["worker_id"] for w in body["workers"]] == ["d0", "d1", "p0"]
    assert body["workers"][0]["heartbeat_age_s"] == 1.5
    assert body["workers"][0]["kv_cache_usage_perc"] == 0.6
    assert body["prefill"]["queued_prefill_tokens"] == 700
    assert (body["cluster"], body["policy"], body["redis_ok"], body["stale"]) == ("c", "cache_aware", True, False)


def test_route_header_names_the_workers_the_wait_and_the_inputs():
    info = RouteInfo("d0", "p1", "cache_aware: ...", (("prefill_uncached_tokens", 24.0), ("x", 0.5)), 0.0123)
    assert info.header_value() == "decode=d0; prefill=p1; queue_ms=12.3; prefill_uncached_tokens=24; x=0.5"
    fallback = RouteInfo("d0", None, "r", (), 0.0, fallback="prefill_failed")
    assert fallback.header_value() == "decode=d0; prefill=-; queue_ms=0.0; fallback=prefill_failed"


def test_policy_sees_at_least_the_prefill_tokens_this_router_has_in_flight():
    async def no_snapshot():
        raise AssertionError("not read in this test")

    backend = ClusterBackend(no_snapshot, lambda *a: None)
    assert backend._with_own_load(SNAPSHOT) is SNAPSHOT  # nothing in flight: unchanged
    backend._prefill_tokens.update({"r1": ("p0", 500), "r2": ("p0", 400), "r3": ("d1", 10)})
    adjusted = backend._with_own_load(SNAPSHOT)
    assert adjusted.by_id("p0").queued_prefill_tokens == 900  # 500 + 400 > the heartbeat's 700
    assert adjusted.by_id("d1").queued_prefill_tokens == 10
    assert adjusted.by_id("d0") == SNAPSHOT.by_id("d0")
