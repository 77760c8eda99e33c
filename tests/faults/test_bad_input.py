"""Bad input against a real `pdserve up` (1 prefill + 1 decode, API key from the environment).

Every case goes over HTTP and gRPC, streaming and not where the endpoint streams. The rules,
for every case: no answer >= 500 but 503; every HTTP 4xx in vLLM's error shape; every gRPC
error a proper code (never UNKNOWN, INTERNAL or UNAVAILABLE); and a canary request after each
case answers the same greedy text as before the first. Then, on the same cluster: reused
request ids (HTTP and gRPC), /ready and gRPC health following the workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.cluster import start_cluster
from tests.faults.bad_inputs import GRPC_CASES, HTTP_CASES, GrpcCase, HttpCase

pytestmark = pytest.mark.slow

KEY = "faults-api-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
CANARY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
ALLOWED_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    saved = os.environ.get("PDSERVE_API_KEY")
    os.environ["PDSERVE_API_KEY"] = KEY  # inherited by `pdserve up` and its router: never argv
    try:
        c = start_cluster(tmp_path_factory.mktemp("faults"), "--prefill", "1", "--decode", "1",
                          "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    finally:
        if saved is None:
            os.environ.pop("PDSERVE_API_KEY")
        else:
            os.environ["PDSERVE_API_KEY"] = saved
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def canary_text(http):
    response = http.post("/v1/completions", json=CANARY, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_vllm_error(response: httpx.Response, case: str) -> None:
    body = response.json()
    assert set(body) == {"error"}, f"{case}: {body}"
    assert set(body["error"]) == {"message", "type", "param", "code"}, f"{case}: {body}"
    assert body["error"]["code"] == response.status_code, f"{case}: {body}"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], f"{case}: {body}"


def send_http(http: httpx.Client, case: HttpCase, stream: bool) -> httpx.Response:
    headers = {**(AUTH if case.auth else {}), **case.headers}
    content = case.content
    if content is None and case.body is not None:
        body = {**case.body, "stream": True} if stream else case.body
        content = json.dumps(body).encode()  # escapes lone surrogates, which httpx will not send
        headers.setdefault("content-type", "application/json")
    return http.request(case.method, case.path, content=content, headers=headers)


def test_bad_http_inputs_never_answer_5xx_and_every_4xx_is_vllm_shaped(http, canary_text):
    seen, open_cases = 0, []
    for case in HTTP_CASES:
        for stream in (False, True) if case.streams else (False,):
            label = f"{case.name} (stream={stream})"
            response = send_http(http, case, stream)
            seen += 1
            assert response.status_code < 500 or response.status_code == 503, f"{label}: {response.text[:300]}"
            if case.expect is not None:
                assert response.status_code == case.expect, f"{label}: {response.text[:300]}"
            else:
                open_cases.append((label, response.status_code))
            if response.status_code >= 400:
                assert_vllm_error(response, label)
        canary = http.post("/v1/completions", json=CANARY, headers=AUTH)
        assert canary.status_code == 200, f"canary after {case.name}: {canary.text[:300]}"
        assert canary.json()["choices"][0]["text"] == canary_text, f"canary after {case.name}"
    print(f"\nHTTP bad-input requests: {seen} from {len(HTTP_CASES)} cases; open cases: {open_cases}")


async def grpc_code(channel: grpc.aio.Channel, case: GrpcCase, stream: bool) -> grpc.StatusCode:
    method = f"/pdserve.v1.Generation/{case.method}"
    metadata = case.metadata if case.metadata is not None else GRPC_AUTH
    try:
        if stream:
            call = channel.unary_stream(method)(case.payload, metadata=metadata, timeout=120)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(method)(case.payload, metadata=metadata, timeout=120)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def grpc_canary(stub) -> str:
    reply = await stub.Generate(generation_pb2.GenerateRequest(
        text=CANARY["prompt"], sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0)),
        metadata=GRPC_AUTH, timeout=120)
    return reply.completions[0].text


def test_bad_grpc_inputs_get_proper_codes_and_a_canary_still_answers(cluster, canary_text):
    async def go():
        seen, open_cases = 0, []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for case in GRPC_CASES:
                streams = (False, True) if case.method == "Generate" else (False,)
                for stream in streams:
                    code = await grpc_code(channel, case, stream)
                    seen += 1
                    label = f"{case.name} ({'GenerateStream' if stream else case.method})"
                    assert code in ALLOWED_GRPC, f"{label}: {code}"
                    if case.expect is not None:
                        assert code == case.expect, f"{label}: {code}"
                    else:
                        open_cases.append((label, code.name))
                assert await grpc_canary(stub) == canary_text, f"canary after {case.name}"
        return seen, open_cases

    seen, open_cases = asyncio.run(go())
    print(f"\ngRPC bad-input calls: {seen} from {len(GRPC_CASES)} cases; open cases: {open_cases}")


def test_a_prompt_just_under_the_size_limit_is_tokenized_without_stalling_other_routes(cluster):
    big = {"prompt": "hello world, this is a test. " * 65_000, "max_tokens": 2}  # 1.9 MB, ~520k tokens

    async def go():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
            task = asyncio.create_task(client.post("/v1/completions", json=big, headers=AUTH))
            worst, polls = 0.0, 0
            while not task.done() and polls < 2400:  # bounded: at most ~2 min of polling
                started = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                worst, polls = max(worst, time.monotonic() - started), polls + 1
                await asyncio.sleep(0.05)
            return await task, worst, polls

    response, worst, polls = asyncio.run(go())
    assert response.status_code == 400
    assert "maximum context length is 1024 tokens" in response.json()["error"]["message"]
    print(f"\n/health while tokenizing 1.9 MB: worst {worst * 1000:.0f} ms over {polls} polls")
    assert polls >= 3, "the big prompt was refused before it was tokenized"
    assert worst < 1.5, f"/health waited {worst:.2f} s behind the tokenizer"


def test_two_streams_reusing_one_x_request_id_both_finish_in_full(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 80, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}

    async def one(client, delay):
        await asyncio.sleep(delay)
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={**AUTH, "x-request-id": "same-id"}) as response:
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "same-id"
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        return json.loads(events[-2])["usage"]["completion_tokens"]

    async def go():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
            return await asyncio.gather(one(client, 0.0), one(client, 1.0))

    assert asyncio.run(go()) == [80, 80]


def test_two_grpc_streams_reusing_one_request_id_both_finish_in_full(cluster):
    msg = generation_pb2.GenerateRequest(
        text="Once upon a time", request_id="same-id",
        sampling=common_pb2.SamplingParams(max_tokens=80, ignore_eos=True, temperature=0))

    async def one(stub, delay):
        await asyncio.sleep(delay)
        tokens, ids = 0, set()
        async for reply in stub.GenerateStream(msg, metadata=GRPC_AUTH, timeout=180):
            tokens += len(reply.token_ids)
            ids.add(reply.request_id)
        return tokens, ids

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(one(stub, 0.0), one(stub, 1.0))

    assert asyncio.run(go()) == [(80, {"same-id"}), (80, {"same-id"})]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def grpc_health(cluster) -> list[int]:
    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return [(await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)).status
                    for name in ("", "pdserve.v1.Generation")]

    return asyncio.run(go())


def test_ready_and_grpc_health_follow_the_prefill_worker_while_health_stays_200(cluster, http):
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert http.get("/ready").json() == {"status": "ready", "prefill_workers": 1, "decode_workers": 1}
    assert grpc_health(cluster) == [serving, serving]
    prefill = next(w for w in cluster.workers if "prefill" in w)
    pid = cluster.worker_pid(prefill)
    os.kill(pid, signal.SIGSTOP)  # its heartbeat stops; the entry expires from Redis (TTL 5 s)
    try:
        gone = wait_for(lambda: (r := http.get("/ready")).status_code == 503 and r, 30, "/ready 503")
        assert gone.json()["error"]["message"] == "not ready: no prefill worker is registered"
        assert http.get("/health").status_code == 200
        wait_for(lambda: grpc_health(cluster) == [not_serving, not_serving], 10, "gRPC NOT_SERVING")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: http.get("/ready").status_code == 200, 30, "/ready 200 again")
    wait_for(lambda: grpc_health(cluster) == [serving, serving], 10, "gRPC SERVING again")
