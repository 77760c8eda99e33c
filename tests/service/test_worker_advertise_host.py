"""Workers bound to every address (--host 0.0.0.0, as in a pod) advertise --advertise-host: Redis
holds 127.0.0.1:port for gRPC and metrics, the decode worker's tickets carry it, and a P/D
request crosses the gloo data channel through it with the same greedy tokens as a prefill on
the decode worker itself. That the servers really bound every address is seen by reaching
them at 127.0.0.2 (another loopback address, which a 127.0.0.1 bind does not answer)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.redis_server import EmbeddedRedis
from proto.auth import load_cluster_secret
from proto.internal_auth import internal_channel
from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.cluster.redis_settings import PASSWORD_ENV
from tests.service.test_worker_process import decode_spec, registered, start, wait_for_state

pytestmark = pytest.mark.timeout(300)
PASSWORD = "advertise-test-password"
PROMPT = list(range(10, 42))
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def redis_url(monkeypatch) -> Iterator[str]:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded.url


@pytest.fixture
def started():
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except Exception:  # noqa: BLE001 — teardown must end them either way
                process.kill()
                process.wait(timeout=10)


def bound_to_all(model, redis_url, tmp_path, role):
    directory = tmp_path / role
    directory.mkdir()
    spec = dataclasses.replace(decode_spec(model, redis_url, directory, role=role), host="0.0.0.0",
                               advertise_host="127.0.0.1")
    return spec, directory


async def pd_request(decode: str, prefill: str, request_id: str):
    secret = load_cluster_secret()
    async with internal_channel(decode, secret) as d_ch, internal_channel(prefill, secret) as p_ch:
        stream = worker_pb2_grpc.DecodeWorkerStub(d_ch).Decode(worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=GREEDY, ticket_timeout_ms=60_000), timeout=120)
        ticket = (await stream.read()).ticket
        reply = await worker_pb2_grpc.PrefillWorkerStub(p_ch).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=GREEDY, ticket=ticket), timeout=120)
        tokens = [reply.first_token_id]
        while (event := await stream.read()) is not grpc.aio.EOF:
            tokens += list(event.tokens.token_ids)
            if event.tokens.finish_reason:
                break
    return ticket, reply.transfer, tokens


async def local_request(decode: str, request_id: str) -> list[int]:
    async with internal_channel(decode, load_cluster_secret()) as channel:
        stream = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=GREEDY, ticket_timeout_ms=60_000,
            local_prefill=True), timeout=120)
        tokens = []
        async for event in stream:
            tokens += list(event.tokens.token_ids)
    return tokens


def test_workers_bound_to_all_addresses_register_and_transfer_through_the_advertised_host(
        tiny_model_dir, redis_url, tmp_path, started):
    ports = {}
    for role in ("decode", "prefill"):
        spec, directory = bound_to_all(tiny_model_dir, redis_url, tmp_path, role)
        _, log, grpc_port, metrics_port = start(spec, directory, started)
        ports[role] = (grpc_port, metrics_port)
        wait_for_state(redis_url, f"{role}-wp", "serving", timeout_s=30)  # the first beat may land after the ready file
        info = registered(redis_url, f"{role}-wp")
        assert info is not None, log.read_text()
        assert (info.address, info.metrics_address) == (f"127.0.0.1:{grpc_port}", f"127.0.0.1:{metrics_port}")
    decode, prefill = (f"127.0.0.1:{ports[r][0]}" for r in ("decode", "prefill"))

    ticket, transfer, pd_tokens = asyncio.run(pd_request(decode, prefill, "adv-1"))
    assert ticket.decode_address == decode
    assert transfer.backend == "gloo" and transfer.bytes > 0 and transfer.num_blocks == 2
    assert pd_tokens == asyncio.run(local_request(decode, "adv-local-1"))
    assert len(pd_tokens) == 6

    for role, (grpc_port, metrics_port) in ports.items():  # bound to every address, not only 127.0.0.1
        assert httpx.get(f"http://127.0.0.2:{metrics_port}/readyz", timeout=10).text == "ok\n"
        with grpc.insecure_channel(f"127.0.0.2:{grpc_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, role
