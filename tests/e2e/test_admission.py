"""Admission control on a real cluster with a deliberately small decode pool (32 blocks =
512 tokens): a flood ends with every request completed or refused with 503 + Retry-After,
nothing hanging and every block free; the documented 400s over HTTP and gRPC; Redis killed
while serving."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import grpc
import httpx
import pytest

from pdserve.redis_server import EmbeddedRedis
from proto.auth import CLUSTER_SECRET_ENV, generate_secret
from router.cluster.redis_settings import PASSWORD_ENV
from tests.e2e.cluster import ROOT, free_port, start_cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
POOL_BLOCKS = 32
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def redis_server():
    """Its password and one cluster secret go into the environment, for `pdserve up` and the
    second router alike (they must verify the same workers' signed heartbeats)."""
    server = EmbeddedRedis(port=free_port()).start()
    env = {PASSWORD_ENV: server.password, CLUSTER_SECRET_ENV: generate_secret()}
    try:
        with mock.patch.dict(os.environ, env):
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server):
    c = start_cluster(
        tmp_path_factory.mktemp("admission"), "--prefill", "1", "--decode", "1", "--dtype", "float32",
        "--max-model-len", "512", "--num-gpu-blocks-override", str(POOL_BLOCKS), "--max-num-seqs", "4",
        "--max-queued-requests", "6", "--max-queue-wait", "6", "--redis-url", redis_server.url)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def wide_router(tmp_path_factory, cluster, redis_server):
    """A second router over the same workers that believes in a 2048-token context, so a
    request can fit max_model_len yet exceed every decode worker's whole KV cache."""
    tmp = tmp_path_factory.mktemp("wide-router")
    ready = tmp / "ready"
    log = (tmp / "router.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "router", "--port", "0", "--grpc-port", "0",
         "--redis-url", redis_server.url, "--max-model-len", "2048", "--ready-file", str(ready)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text().strip()):
            assert process.poll() is None and time.monotonic() < deadline, (tmp / "router.log").read_text()
            time.sleep(0.2)
        http_port, grpc_port = map(int, ready.read_text().split())
        yield f"http://127.0.0.1:{http_port}", grpc_port
    finally:
        process.terminate()
        process.wait(timeout=30)


def _prompt(i: int, n: int = 150) -> list[int]:
    return [(37 * j + 101 * i) % 30000 + 500 for j in range(n)]


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the first sample of `name` whose labels include `labels`."""
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no sample {name} {labels} in:\n{text[:2000]}")


def _wait_all_blocks_free(cluster, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = {w: (_metric(cluster.metrics(w), "vllm:kv_cache_usage_perc"),
                     _metric(cluster.metrics(w), "pdserve_kv_blocks_reserved")) for w in cluster.workers}
        if all(u == (0.0, 0.0) for u in usage.values()):
            return
        assert time.monotonic() < deadline, f"blocks still held: {usage}"
        time.sleep(0.5)


def _grpc_request(i: int, max_tokens: int, prompt: list[int] | None = None):
    from proto.pdserve.v1 import common_pb2, generation_pb2

    return generation_pb2.GenerateRequest(
        model=MODEL, token_ids=generation_pb2.TokenIds(ids=prompt or _prompt(i)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_flood_ends_with_every_request_completed_or_refused_with_retry_after(cluster):
    from proto.pdserve.v1 import generation_pb2_grpc

    async def http_one(client, i):
        return await client.post("/v1/completions", json={
            "model": MODEL, "prompt": _prompt(i), "max_tokens": 100, "temperature": 0, "ignore_eos": True})

    async def grpc_one(stub, i):
        try:
            reply = await stub.Generate(_grpc_request(i, 100), timeout=180)
            return "ok", len(reply.completions[0].token_ids), None
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, exc.details(), dict(exc.trailing_metadata() or ())

    async def flood():
        # 40 requests x 16 blocks (150 prompt + 100 output tokens) = 20x the 32-block pool.
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client, \
                grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            http = [asyncio.create_task(http_one(client, i)) for i in range(30)]
            rpcs = [asyncio.create_task(grpc_one(stub, i)) for i in range(30, 40)]
            return await asyncio.wait_for(asyncio.gather(asyncio.gather(*http), asyncio.gather(*rpcs)), 240)

    started = time.monotonic()
    responses, rpcs = asyncio.run(flood())
    elapsed = time.monotonic() - started
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, [r.text for r in responses if r.status_code not in (200, 503)]
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 100
        else:
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
            assert "retry in about" in error["message"]
    for status, detail, metadata in rpcs:
        assert status in ("ok", "RESOURCE_EXHAUSTED"), (status, detail)
        if status == "ok":
            assert detail == 100
        else:
            assert int(metadata["retry-after"]) >= 1 and "retry in about" in detail
    outcomes = codes + [200 if s == "ok" else 503 for s, _, _ in rpcs]
    assert outcomes.count(200) >= 3 and outcomes.count(503) >= 10, outcomes
    assert elapsed < 200
    assert cluster.process.poll() is None
    assert httpx.get(f"{cluster.base_url}/health", timeout=10).status_code == 200
    _wait_all_blocks_free(cluster)
    router = cluster.metrics()
    assert _metric(router, "pdserve_admission_rejections_total", reason="queue_full") >= 1
    assert _metric(router, "vllm:num_requests_waiting", role="router") == 0
    assert _metric(router, "vllm:request_queue_time_seconds_count") >= outcomes.count(200)


def test_context_length_error_is_vllms_400_over_http_and_invalid_argument_over_grpc(cluster):
    from proto.pdserve.v1 import generation_pb2_grpc

    message = ("'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context "
               "length is 512 tokens and your request has 450 input tokens (100 > 512 - 450).")
    r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": _prompt(0, 450), "max_tokens": 100})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": "max_tokens",
                                  "code": 400}}
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(channel).Generate(_grpc_request(0, 100, _prompt(0, 450)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message


def test_request_larger_than_any_decode_pool_is_a_400_with_the_numbers(cluster, wide_router):
    from proto.pdserve.v1 import generation_pb2_grpc

    base_url, grpc_port = wide_router
    message = ("This request needs 600 tokens of KV cache (450 prompt + 150 max_tokens), but the largest "
               "decode worker holds 512 tokens (32 blocks x 16). Reduce the prompt or max_tokens.")
    r = httpx.post(f"{base_url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": _prompt(1, 450), "max_tokens": 150})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": "max_tokens",
                                 "code": 400}
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(channel).Generate(_grpc_request(1, 150, _prompt(1, 450)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message
    assert _metric(httpx.get(f"{base_url}/metrics").text, "pdserve_admission_rejections_total",
                   reason="exceeds_kv_capacity") == 2


def test_cluster_view_sums_the_decode_pool_and_lists_every_worker(cluster):
    body = httpx.get(f"{cluster.base_url}/v1/cluster", timeout=10).json()
    assert body["redis_ok"] is True and body["stale"] is False
    assert body["decode"]["workers"] == 1 and body["decode"]["total_blocks"] == POOL_BLOCKS
    assert body["decode"]["capacity_tokens"] == POOL_BLOCKS * BLOCK_SIZE
    assert sorted(w["worker_id"] for w in body["workers"]) == ["decode-0", "prefill-0"]
    assert body["admission_queue"]["max_queued"] == 6
    router = cluster.metrics()
    assert _metric(router, "pdserve_cluster_kv_blocks_total", role="decode") == POOL_BLOCKS


def test_requests_keep_succeeding_while_redis_is_down_and_the_view_catches_up_after(cluster, redis_server):
    def complete(i: int) -> httpx.Response:
        return httpx.post(f"{cluster.base_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": _prompt(i, 40), "max_tokens": 4, "temperature": 0})

    first = complete(100)
    assert first.status_code == 200
    # Where it went and why, in one header: the workers, the queue wait, the policy's inputs.
    route = first.headers["x-pdserve-route"]
    assert route.startswith("decode=decode-0; prefill=prefill-0; queue_ms="), route
    assert "prefill_uncached_tokens=" in route and "decode_headroom_blocks=" in route, route
    redis_server.kill()
    try:
        for i in range(101, 104):
            r = complete(i)
            assert r.status_code == 200, r.text
        view = httpx.get(f"{cluster.base_url}/v1/cluster", timeout=10).json()
        assert view["redis_ok"] is False and view["stale"] is True
        assert len(view["workers"]) == 2  # still routing on the last snapshot
    finally:
        redis_server.start()  # same port: workers and routers hold its URL
    back = time.monotonic()
    ttl_s = 5.0  # pdserve up's default --heartbeat-ttl
    while True:
        view = httpx.get(f"{cluster.base_url}/v1/cluster", timeout=10).json()
        if view["redis_ok"] and not view["stale"] and len(view["workers"]) == 2:
            break
        assert time.monotonic() - back < ttl_s, view
        time.sleep(0.1)
    assert complete(105).status_code == 200
    _wait_all_blocks_free(cluster)


def test_with_every_prefill_worker_gone_the_decode_worker_prefills_and_answers_the_same(cluster):
    # Runs last in this module: it kills the only prefill worker.
    def complete() -> httpx.Response:
        return httpx.post(f"{cluster.base_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": _prompt(7, 60), "max_tokens": 8, "temperature": 0, "ignore_eos": True})

    before = complete()
    assert before.status_code == 200 and before.headers["x-pdserve-path"] == "disaggregated"
    os.kill(cluster.worker_pid("prefill-0"), signal.SIGKILL)
    # Within the heartbeat TTL the router still lists prefill-0: its Prefill call fails, and the
    # decode worker that holds the reservation prefills the prompt itself.
    after = complete()
    assert after.status_code == 200, after.text
    assert after.headers["x-pdserve-path"] == "colocated"
    assert "fallback=prefill_failed" in after.headers["x-pdserve-route"]
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert _metric(cluster.metrics(), "pdserve_path_fallbacks_total", reason="prefill_failed") == 1
    _wait_all_blocks_free_on(cluster, "decode-0")


def _wait_all_blocks_free_on(cluster, worker_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _metric(cluster.metrics(worker_id), "vllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, f"{worker_id} still holds blocks"
        time.sleep(0.5)
