"""A colocated `pdserve up` (decode workers only) is ready: its router knows no prefill worker
is expected, so /ready and gRPC health do not wait for one."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.cluster import start_cluster

pytestmark = pytest.mark.slow


def test_a_colocated_cluster_is_ready_without_prefill_workers(tmp_path):
    cluster = start_cluster(tmp_path, "--colocated", "--decode", "1", "--max-model-len", "512",
                            "--kv-cache-memory", "128MiB")
    try:
        ready = httpx.get(cluster.base_url + "/ready", timeout=30)
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "ready", "prefill_workers": 0, "decode_workers": 1}

        async def health():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return (await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"),
                                         timeout=10)).status

        assert asyncio.run(health()) == health_pb2.HealthCheckResponse.SERVING
    finally:
        cluster.stop()
