"""`pdserve up --prefill 2 --decode 2` with the real model, through the public HTTP and gRPC
APIs: greedy tokens and logprobs equal the offline engine's, every response says it was
disaggregated, transfers show in /metrics, and every block is free afterwards."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import pytest

from tests.e2e.cluster import port_is_free, start_cluster
from tests.real_model import prompt_token_ids

pytestmark = pytest.mark.slow
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference():
    """The offline engine's greedy tokens and logprobs, computed before the cluster starts."""
    from engine import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024)
    outs = llm.generate([list(p) for p in prompt_token_ids()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
    tokens = [list(o.token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids)] for o in outs]
    del llm
    return tokens, logprobs


@pytest.fixture(scope="module")
def cluster(reference, tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("up"), "--prefill", "2", "--decode", "2", "--dtype", "float32",
                      "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    try:
        yield c
        worker_pids = {w: c.worker_pid(w) for w in c.workers}
    finally:
        c.stop()
    time.sleep(1)
    leftovers = [w for w, pid in worker_pids.items() if _alive(pid)]
    assert not leftovers, f"worker processes left running: {leftovers}"
    busy = [a for w in c.workers for a in c.workers[w] if not port_is_free(int(a.rsplit(":", 1)[1]))]
    assert port_is_free(c.http_port) and port_is_free(c.grpc_port) and not busy, busy


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_openai_client_chats_streaming_and_not(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_openai_client_completes_streaming_and_not_with_the_offline_engines_tokens(cluster, reference):
    from openai import OpenAI

    want_tokens, _ = reference
    prompt = list(prompt_token_ids()[0])
    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", timeout=120)
    extra = {"ignore_eos": True, "return_token_ids": True}
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=extra)
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra))
    assert reply.choices[0].token_ids == want_tokens[0]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
    assert sum((c.choices[0].token_ids for c in chunks if c.choices), []) == want_tokens[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt), MAX_TOKENS)


def test_grpc_reflection_client_streams_and_reads_usage(cluster, reference):
    """A client with no generated stubs: the service and its messages come from reflection."""
    from google.protobuf import json_format, message_factory
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    want_tokens, _ = reference
    prompt = list(prompt_token_ids()[1])
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "pdserve.v1.Generation" in database.get_services()
        method = DescriptorPool(database).FindServiceByName("pdserve.v1.Generation").FindMethodByName("GenerateStream")
        request_cls = message_factory.GetMessageClass(method.input_type)
        reply_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.ParseDict({"token_ids": {"ids": prompt}, "sampling": {
            "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}, request_cls())
        call = channel.unary_stream("/pdserve.v1.Generation/GenerateStream",
                                    request_serializer=request_cls.SerializeToString,
                                    response_deserializer=reply_cls.FromString)
        replies = list(call(request, timeout=120))
    assert sum((list(r.token_ids) for r in replies), []) == want_tokens[1]
    final = replies[-1]
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
    assert [r.HasField("usage") for r in replies[:-1]] == [False] * (len(replies) - 1)


def test_concurrent_greedy_requests_match_the_offline_engine(cluster, reference):
    want_tokens, want_logprobs = reference

    async def one(client: httpx.AsyncClient, ids):
        r = await client.post("/v1/completions", json={
            "model": "SmolLM2-135M-Instruct", "prompt": list(ids), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r

    async def all_at_once():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as client:
            return await asyncio.gather(*(one(client, ids) for ids in prompt_token_ids()))

    responses = asyncio.run(all_at_once())
    assert [r.headers["x-pdserve-path"] for r in responses] == ["disaggregated"] * len(responses)
    choices = [r.json()["choices"][0] for r in responses]
    assert [c["token_ids"] for c in choices] == want_tokens
    worst = max(abs(a - b) for c, w in zip(choices, want_logprobs) for a, b in zip(c["logprobs"]["token_logprobs"], w))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_grpc_returns_the_same_tokens_as_http(cluster, reference):
    from proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    want_tokens, _ = reference
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        got = []
        for ids in prompt_token_ids()[:6]:
            reply = stub.Generate(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=list(ids)),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)),
                timeout=120)
            assert reply.path == "disaggregated"
            got.append(list(reply.completions[0].token_ids))
        streamed = [list(m.token_ids) for m in stub.GenerateStream(generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=list(prompt_token_ids()[0])),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120)]
    assert got == want_tokens[:6]
    assert sum(streamed, []) == want_tokens[0]


def _metric(text: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in metrics"
    return sum(values)


def test_router_and_worker_metrics_show_kv_transfers(cluster):
    router = cluster.metrics()
    assert _metric(router, "pdserve_kv_transfer_bytes_total") > 0
    assert _metric(router, "pdserve_kv_transfer_seconds_total") > 0
    for worker_id in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        text = cluster.metrics(worker_id)
        assert _metric(text, "pdserve_kv_transfer_bytes_total") > 0, worker_id
        assert _metric(text, "pdserve_kv_transfer_seconds_total") > 0, worker_id


def test_client_disconnect_mid_stream_frees_blocks_on_both_sides(cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": list(prompt_token_ids()[20]), "max_tokens": 900,
                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = sum(_metric(cluster.metrics(w), "vllm:num_requests_running") for w in cluster.workers)
        if running == 0:
            break
        time.sleep(0.2)
    assert running == 0


def test_every_block_is_free_on_every_worker_afterwards(cluster):
    deadline = time.monotonic() + 30
    while True:
        usage = {w: (_metric(cluster.metrics(w), "vllm:kv_cache_usage_perc"),
                     _metric(cluster.metrics(w), "pdserve_kv_blocks_reserved")) for w in cluster.workers}
        if all(v == (0.0, 0.0) for v in usage.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert usage == {w: (0.0, 0.0) for w in cluster.workers}
