"""GET /v1/dashboard/state's body, built by the real DashboardState over the real RolesApi
(a recording scaler, fixed snapshots) and the backend's real counters: KV bars, capacity in
FastDeploy's terms, pending changes, the queue and rejections. Exact values."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest

from router.ops.dashboard.state import (DashboardSettings, DashboardState, MeanLength, kv_bar, mean_length,
                                        pending, role_capacity)
from router.ops.roles import RoleStatus
from router.ops.scaling import ScalerUnavailable
from router.ops.timeline import Phase, Timeline, TimelineStore
from router.routing.admission import AdmissionQueue, AdmissionSettings
from router.routing.cluster_backend import TransferTotals
from tests.unit.roles_doubles import CLUSTER, NOW, FakeScaler, roles_api, worker

SETTINGS = DashboardSettings(cluster="c1", model="m", max_model_len=2048, policy="cache_aware")


def counters() -> SimpleNamespace:
    return SimpleNamespace(admission=AdmissionQueue(AdmissionSettings(max_queued=8, max_wait_s=5.0)),
                           rejections=Counter(), fallbacks=Counter(), transfers=TransferTotals())


def timeline(rid: str, prompt: int, completion: int) -> Timeline:
    return Timeline(request_id=rid, arrival_unix=NOW, e2e_ms=10.0, phases=(Phase("decode", 0.0, 10.0),),
                    finish_reason="length", prompt_tokens=prompt, completion_tokens=completion)


def state(scaler=None, timelines=None, backend=None, cluster=CLUSTER) -> DashboardState:
    roles = roles_api(scaler, cluster=cluster)

    async def read():
        return cluster

    return DashboardState(SETTINGS, roles, read, backend or counters(), timelines, clock=lambda: NOW)


def test_kv_bar_splits_total_into_used_reserved_cached_free():
    w = replace(worker("d", "decode", free_blocks=60), reserved_blocks=10, cached_blocks=20)
    assert kv_bar(w) == {"used": 40, "reserved": 10, "cached": 20, "free": 30}


def test_kv_bar_never_shows_more_reserved_and_cached_than_free():
    w = replace(worker("d", "decode", free_blocks=15), reserved_blocks=10, cached_blocks=20)
    assert kv_bar(w) == {"used": 85, "reserved": 10, "cached": 5, "free": 0}


def test_mean_length_is_prompt_plus_output_over_the_last_n_requests():
    store = TimelineStore(capacity=10)
    for i, (p, c) in enumerate([(1000, 1000), (100, 20), (300, 60), (0, 0)]):
        store.put(timeline(f"r{i}", p, c))
    assert mean_length(store, 2, 2048) == MeanLength(360.0, 1, "mean prompt + output of the last 1 request")
    assert mean_length(store, 3, 2048) == MeanLength(240.0, 2, "mean prompt + output of the last 2 requests")


def test_before_any_request_capacity_is_computed_at_max_model_len():
    assert mean_length(TimelineStore(), 100, 2048) == MeanLength(2048.0, 0, "max_model_len (no finished request yet)")
    assert mean_length(None, 100, 2048) == MeanLength(2048.0, 0, "max_model_len (no finished request yet)")


def test_role_capacity_is_blocks_times_block_size_over_the_mean_length():
    members = [worker("d0", "decode", free_blocks=50), replace(worker("d1", "decode"), reserved_blocks=30)]
    assert role_capacity(members, MeanLength(300.0, 7, "")) == {
        "blocks": 200, "block_size": 16, "tokens": 3200, "free_tokens": 800 + 1120,
        "mean_request_tokens": 300.0, "concurrency": 10, "free_concurrency": 6,
        "formula": "200 blocks x 16 tokens = 3200 tokens; / 300 tokens per request = 10 requests"}


@pytest.mark.parametrize("desired, ready, draining, expected", [
    (2, 1, 0, "1 starting"), (1, 2, 0, "1 to remove"), (1, 1, 1, "1 draining"),
    (3, 1, 1, "2 starting, 1 draining"), (1, 1, 0, None), (None, 1, 0, None)])
def test_pending_says_what_the_role_still_has_to_do(desired, ready, draining, expected):
    assert pending(RoleStatus("decode", desired, ready, draining, 0, ())) == expected


def test_state_body_joins_the_roles_api_counts_with_each_workers_kv():
    backend = counters()
    backend.rejections["no_decode_worker"] += 2
    backend.admission.rejections["queue_full"] += 1
    backend.fallbacks["local_prefill"] += 4
    backend.transfers.add("prefill-0", "decode-0", 2_000_000, 0.001)
    store = TimelineStore()
    store.put(timeline("r1", 150, 50))
    body = asyncio.run(state(FakeScaler(), store, backend).body())
    assert {k: body[k] for k in ("now_unix", "cluster", "model", "policy", "max_model_len", "stale", "scaler",
                                 "scaler_error", "mean_length")} == {
        "now_unix": NOW, "cluster": "c1", "model": "m", "policy": "cache_aware", "max_model_len": 2048,
        "stale": False, "scaler": "fake", "scaler_error": None,
        "mean_length": {"tokens": 200.0, "requests": 1, "basis": "mean prompt + output of the last 1 request"}}
    prefill, decode = body["roles"]
    assert [(r["role"], r["desired"], r["ready"], r["draining"], r["restarts"], r["pending"]) for r in body["roles"]] == [
        ("prefill", 1, 1, 0, 0, None), ("decode", 2, 1, 1, 3, "1 starting, 1 draining")]
    assert decode["capacity"]["formula"] == "200 blocks x 16 tokens = 3200 tokens; / 200 tokens per request = 16 requests"
    assert [(w["worker_id"], w["state"], w["kv_bar"], w["heartbeat_age_s"]) for w in decode["workers"]] == [
        ("decode-0", "serving", {"used": 0, "reserved": 0, "cached": 0, "free": 100}, 0.25),
        ("decode-1", "draining", {"used": 0, "reserved": 0, "cached": 0, "free": 100}, 0.25)]
    assert prefill["workers"][0]["heartbeat_age_s"] == 1.5
    assert body["admission"] == {"waiting": 0, "max_queued": 8, "max_wait_s": 5.0, "blocks_waiting": 0,
                                 "rejections": {"queue_full": 1, "no_decode_worker": 2}}
    assert body["fallbacks"] == {"local_prefill": 4}
    assert body["transfers"] == {"count": 1, "nbytes": 2_000_000, "seconds": 0.001, "links": [
        {"prefill_id": "prefill-0", "decode_id": "decode-0", "count": 1, "nbytes": 2_000_000, "seconds": 0.001,
         "gbps": 2.0}]}


def test_when_the_scaler_cannot_be_read_the_workers_still_show_with_desired_unknown_and_why():
    body = asyncio.run(state(FakeScaler(fail=ScalerUnavailable("no supervisor"))).body())
    assert body["scaler"] == "fake"
    assert body["scaler_error"] == "The scaler 'fake' is unavailable: no supervisor"
    assert [(r["role"], r["desired"], r["ready"], len(r["workers"])) for r in body["roles"]] == [
        ("prefill", None, 1, 1), ("decode", None, 1, 2)]


def test_without_a_scaler_desired_is_null_and_nothing_is_pending():
    body = asyncio.run(state().body())
    assert body["scaler"] is None
    assert [(r["desired"], r["pending"]) for r in body["roles"]] == [(None, None), (None, None)]


@pytest.mark.parametrize("field, value, message", [
    ("max_model_len", 0, "max_model_len must be >= 1, got 0"), ("mean_over", 0, "mean_over must be >= 1, got 0")])
def test_settings_refuse_nonsense(field, value, message):
    with pytest.raises(ValueError, match=message):
        replace(SETTINGS, **{field: value})
