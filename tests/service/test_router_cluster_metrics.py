"""The router's /metrics (the one a Prometheus scrapes) carries vLLM's per-worker gauges and
prefix-cache counters for the whole cluster: built by `pdserve router`'s own build_service, read
from real signed heartbeats in a real (embedded) Redis."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core import CoreStats
from pdserve.cli import build_parser
from pdserve.redis_server import EmbeddedRedis
from pdserve.router_main import build_service
from proto.auth import CLUSTER_SECRET_ENV
from router.api.http import HttpSettings, create_app
from router.cluster.redis_settings import PASSWORD_ENV
from worker_runtime.heartbeat import HeartbeatPublisher, heartbeat_info
from worker_runtime.status import TransferTotals, WorkerState, WorkerStatus

pytestmark = pytest.mark.timeout(120)

PASSWORD = "metrics-test-password"
SECRET = "metrics-test-cluster-secret"
CLUSTER = "metrics"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def secrets_in_env(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)


@pytest.fixture
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded


def status(worker_id: str, role: str, **core: int) -> WorkerStatus:
    stats = CoreStats(**{"total_blocks": 100, "free_blocks": 100, "reserved_blocks": 0, "cached_blocks": 0,
                         "num_running": 0, "num_waiting": 0, "num_reserved": 0, "queued_prefill_tokens": 0,
                         "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0, **core})
    return WorkerStatus(worker_id=worker_id, incarnation=f"{worker_id}-inc", role=role, state=WorkerState.SERVING,
                        block_size=16, max_model_len=2048, core=stats, in_flight=0, transfers=TransferTotals())


DECODE = status("decode-0", "decode", free_blocks=75, num_running=3, num_waiting=2,
                prefix_cache_queries=640, prefix_cache_hits=160)
PREFILL = status("prefill-0", "prefill", total_blocks=200, free_blocks=150, num_running=1, num_waiting=4,
                 prefix_cache_queries=800, prefix_cache_hits=320)


def beat_once(url: str, worker: WorkerStatus) -> HeartbeatPublisher:
    """One heartbeat as a worker process writes it: from its status, signed with the secret."""
    publisher = HeartbeatPublisher(url, CLUSTER, lambda: heartbeat_info(worker, "127.0.0.1:1", "127.0.0.1:2"),
                                   interval_s=1.0, ttl_s=30.0, secret=SECRET.encode())
    assert publisher.beat()
    return publisher


def scrape_router(url: str) -> str:
    args = build_parser().parse_args(["router", "--redis-url", url, "--cluster", CLUSTER])

    async def main() -> str:
        service, backend, reader = build_service(args)
        try:
            await reader.snapshot()
            app = create_app(service, HttpSettings())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                response = await client.get("/metrics")
            assert response.status_code == 200
            return response.text
        finally:
            await backend.close()
            await reader.aclose()

    return asyncio.run(main())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def labels(role: str, worker_id: str) -> tuple[tuple[str, str], ...]:
    return (("model_name", MODEL), ("role", role), ("worker_id", worker_id))


def test_router_metrics_carry_vllm_gauges_per_worker_from_signed_heartbeats(redis):
    publishers = [beat_once(redis.url, DECODE), beat_once(redis.url, PREFILL)]
    try:
        found = samples(scrape_router(redis.url))
    finally:
        for publisher in publishers:
            publisher.stop()
    expected = {
        ("vllm:num_requests_running", labels("decode", "decode-0")): 3.0,
        ("vllm:num_requests_running", labels("prefill", "prefill-0")): 1.0,
        ("vllm:num_requests_waiting", labels("decode", "decode-0")): 2.0,
        ("vllm:num_requests_waiting", labels("prefill", "prefill-0")): 4.0,
        ("vllm:num_requests_waiting", labels("router", "")): 0.0,
        ("vllm:kv_cache_usage_perc", labels("decode", "decode-0")): 0.25,
        ("vllm:kv_cache_usage_perc", labels("prefill", "prefill-0")): 0.25,
        ("vllm:prefix_cache_queries_total", labels("decode", "decode-0")): 640.0,
        ("vllm:prefix_cache_queries_total", labels("prefill", "prefill-0")): 800.0,
        ("vllm:prefix_cache_hits_total", labels("decode", "decode-0")): 160.0,
        ("vllm:prefix_cache_hits_total", labels("prefill", "prefill-0")): 320.0,
        ("pdserve_cluster_kv_cache_usage_perc", (("role", "decode"),)): 0.25,
        ("pdserve_cluster_kv_cache_usage_perc", (("role", "prefill"),)): 0.25,
    }
    assert {key: found.get(key) for key in expected} == expected
    vllm_series = {key for key in found if key[0].startswith("vllm:num_requests_")}
    assert vllm_series == {key for key in expected if key[0].startswith("vllm:num_requests_")}


def test_no_metric_of_the_router_or_a_worker_is_named_with_a_pdserve_colon(redis):
    from prometheus_client import CollectorRegistry, generate_latest

    from worker_runtime.metrics import WorkerCollector

    publisher = beat_once(redis.url, DECODE)
    try:
        router_text = scrape_router(redis.url)
    finally:
        publisher.stop()
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: DECODE, capacity=[], model_name=MODEL))
    worker_text = generate_latest(registry).decode()
    names = {f.name for text in (router_text, worker_text) for f in text_string_to_metric_families(text)}
    assert "pdserve_request_path" in names and "vllm:num_requests_running" in names
    assert sorted(n for n in names if not (n.startswith("pdserve_") or n.startswith("vllm:"))) == []
    assert [n for n in names if n.startswith("pdserve:")] == []


def test_a_draining_worker_still_counts_in_the_router_gauges(redis):
    draining = dataclasses.replace(DECODE, state=WorkerState.DRAINING)
    publisher = beat_once(redis.url, draining)
    try:
        found = samples(scrape_router(redis.url))
    finally:
        publisher.stop()
    assert found[("vllm:num_requests_running", labels("decode", "decode-0"))] == 3.0
