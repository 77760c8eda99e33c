"""Draining through real pieces: signed heartbeats in a real Redis read by the router's
ClusterStateReader, and the Drain RPC over a real gRPC server that checks the cluster secret.
The worker servicers here are small doubles for the other side of the seam (they answer Drain
and record it); the router side is the real ClusterBackend channel pool, WorkerDrainer,
RolesApi and FastAPI app."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from pdserve.redis_server import EmbeddedRedis, free_port
from proto.internal_auth import ClusterAuthServerInterceptor
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.routing.cluster_backend import ClusterBackend
from router.cluster.keys import signed_hash, worker_key, workers_set_key
from router.cluster.state import ClusterStateReader
from router.api.http import HttpSettings, create_app
from router.ops.access import AdminAccess
from router.ops.drain_call import WorkerDrainer
from router.ops.roles import RolesApi
from router.routing.policy import RouteRequest, least_loaded
from router.cluster.readiness import readiness
from router.cluster.redis_settings import PASSWORD_ENV, sync_client
from tests.unit.roles_doubles import worker
from tests.unit.router_doubles import ScriptedBackend, make_service, token_steps

pytestmark = pytest.mark.timeout(60)

PASSWORD = "service-test-password"
CLUSTER = "drain-test"
SECRET = b"drain-test-cluster-secret"


@pytest.fixture(autouse=True)
def redis_password_in_env(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)


@pytest.fixture
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded


def publish(url: str, *infos) -> None:
    """Write heartbeats as workers do: signed with the cluster secret, fresh, with a TTL."""
    client = sync_client(url, decode_responses=True)
    try:
        for info in infos:
            info = dataclasses.replace(info, updated_at=time.time())
            client.hset(worker_key(CLUSTER, info.worker_id), mapping=signed_hash(info, CLUSTER, SECRET))
            client.pexpire(worker_key(CLUSTER, info.worker_id), 30_000)
            client.sadd(workers_set_key(CLUSTER), info.worker_id)
    finally:
        client.close()


def test_a_worker_marked_draining_in_redis_gets_no_new_work_from_the_next_snapshot(redis):
    d0, d1, p0 = worker("decode-0", "decode", free_blocks=10), worker("decode-1", "decode"), worker("p-0", "prefill")
    publish(redis.url, d0, d1, p0)

    async def main() -> float:
        reader = ClusterStateReader(redis.url, CLUSTER, secret=SECRET)  # the router's 100 ms cache
        try:
            before = await reader.snapshot()
            assert least_loaded_decode(before) == "decode-1"  # the emptiest, while it serves
            publish(redis.url, dataclasses.replace(d1, state="draining"))
            started = time.monotonic()
            while [w.worker_id for w in (await reader.snapshot()).decode_workers()] != ["decode-0"]:
                assert time.monotonic() - started < 5, "the draining worker stayed a candidate"
                await asyncio.sleep(0.01)
            took = time.monotonic() - started
            after = await reader.snapshot()
            assert least_loaded_decode(after) == "decode-0"
            assert [w.worker_id for w in after.members("decode")] == ["decode-0", "decode-1"]
            assert readiness(after, needs_prefill=True).decode_workers == 1
            return took
        finally:
            await reader.aclose()

    took = asyncio.run(main())
    assert took < 1.0  # one snapshot period is 0.1 s; generous for a loaded machine


def least_loaded_decode(snapshot) -> str:
    return least_loaded(RouteRequest(16, 16), snapshot, random.Random(0)).decode_id


class DrainDouble:
    """Answers Drain like a worker: started the first time, then already draining."""

    def __init__(self) -> None:
        self.calls = 0

    async def Drain(self, request, context):
        self.calls += 1
        return worker_pb2.DrainResponse(started=self.calls == 1, in_flight=3)


class DecodeDouble(DrainDouble, worker_pb2_grpc.DecodeWorkerServicer):
    pass


class PrefillDouble(DrainDouble, worker_pb2_grpc.PrefillWorkerServicer):
    pass


async def start_workers(secret: bytes):
    server = grpc.aio.server(interceptors=[ClusterAuthServerInterceptor(secret)])
    decode, prefill = DecodeDouble(), PrefillDouble()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, server)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, decode, prefill


def roles_app(reader: ClusterStateReader, backend: ClusterBackend, timeout_s: float = 5.0):
    roles = RolesApi(reader.snapshot, None, WorkerDrainer(backend.channel, timeout_s))
    settings = HttpSettings(roles=roles, admin_access=AdminAccess(None, None, "127.0.0.1"))
    return create_app(make_service(ScriptedBackend(token_steps([1]))), settings)


def test_post_drain_calls_the_workers_drain_rpc_with_the_cluster_secret(redis):
    async def main():
        server, port, decode, prefill = await start_workers(SECRET)
        address = f"127.0.0.1:{port}"
        publish(redis.url, dataclasses.replace(worker("decode-0", "decode"), address=address),
                dataclasses.replace(worker("prefill-0", "prefill"), address=address))
        reader = ClusterStateReader(redis.url, CLUSTER, secret=SECRET)
        backend = ClusterBackend(reader.snapshot, least_loaded, secret=SECRET)
        try:
            app = roles_app(reader, backend)
            replies = [await async_call(app, "POST", f"/v1/workers/{w}/drain")
                       for w in ("decode-0", "decode-0", "prefill-0")]
            return [(r.status_code, r.json()) for r in replies], decode.calls, prefill.calls
        finally:
            await backend.close()
            await reader.aclose()
            await server.stop(0)

    replies, decode_calls, prefill_calls = asyncio.run(main())
    assert replies == [(202, {"worker_id": "decode-0", "started": True, "in_flight": 3}),
                       (202, {"worker_id": "decode-0", "started": False, "in_flight": 3}),
                       (202, {"worker_id": "prefill-0", "started": True, "in_flight": 3})]
    assert (decode_calls, prefill_calls) == (2, 1)


def test_a_drain_the_worker_refuses_or_cannot_receive_is_500_naming_the_worker(redis):
    async def main():
        server, port, decode, _ = await start_workers(b"another-clusters-secret")
        publish(redis.url, dataclasses.replace(worker("decode-0", "decode"), address=f"127.0.0.1:{port}"),
                dataclasses.replace(worker("decode-gone", "decode"), address=f"127.0.0.1:{free_port()}"))
        reader = ClusterStateReader(redis.url, CLUSTER, secret=SECRET)
        backend = ClusterBackend(reader.snapshot, least_loaded, secret=SECRET)
        try:
            app = roles_app(reader, backend, timeout_s=2.0)
            started = time.monotonic()
            refused = await async_call(app, "POST", "/v1/workers/decode-0/drain")
            gone = await async_call(app, "POST", "/v1/workers/decode-gone/drain")
            return refused, gone, time.monotonic() - started, decode.calls
        finally:
            await backend.close()
            await reader.aclose()
            await server.stop(0)

    refused, gone, took, calls = asyncio.run(main())
    assert (refused.status_code, calls) == (500, 0)
    assert refused.json()["error"]["message"].startswith("Drain on decode worker decode-0 failed: UNAUTHENTICATED")
    assert gone.status_code == 500
    assert gone.json()["error"]["message"].startswith("Drain on decode worker decode-gone failed: UNAVAILABLE")
    assert took < 20  # each call is bounded by 2 s


async def async_call(app, method: str, path: str):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        return await client.request(method, path)
