"""Usage over the public gRPC API of a real `pdserve up` (router, 1 prefill, 1 decode, embedded
Redis, gloo transfers) running the tiny random-weight model: the final GenerateStream message
and the unary reply count the prompt as the tokenizer does, the completion as the token ids that
came back, and, when the same prompt comes again, the prompt tokens its full blocks served from
the prefix cache. The tokens themselves are noise (tests/tiny_model.py); only counts matter."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from engine.loader.locate import default_model_path
from proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.cluster import RunningCluster, start_cluster
from tests.tiny_model import write_tiny_model
from tests.unit.router_doubles import smollm2_tokenizer

pytestmark = pytest.mark.timeout(600)

BLOCK_SIZE = 16
MAX_TOKENS = 6
# 40 prompt tokens: two full blocks (32 tokens) can come from the prefix cache the second time.
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the "
        "old window of a small red house near the quiet river bank, where children play and birds sing.")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RunningCluster]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    c = start_cluster(tmp_path_factory.mktemp("up"), "--model", str(model), "--tokenizer", str(default_model_path()),
                      "--prefill", "1", "--decode", "1", "--dtype", "float32", "--max-model-len", "512",
                      "--block-size", str(BLOCK_SIZE), "--kv-cache-memory", "32MiB", timeout_s=300)
    try:
        yield c
    finally:
        c.stop()


def request(prompt_ids: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt_ids),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))


def usage(msg) -> tuple[int, int, int]:
    return msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens


def test_grpc_usage_counts_prompt_completion_and_cached_tokens(cluster: RunningCluster):
    prompt = smollm2_tokenizer().encode(TEXT)
    assert len(prompt) == 40
    cached_when_repeated = (len(prompt) // BLOCK_SIZE) * BLOCK_SIZE
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = list(stub.GenerateStream(request(prompt), timeout=180))
        time.sleep(1)  # block events reach the router's prefix index
        again = list(stub.GenerateStream(request(prompt), timeout=180))
        unary = stub.Generate(request(prompt), timeout=180)
        text = list(stub.GenerateStream(generation_pb2.GenerateRequest(
            text=TEXT[:40], sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)), timeout=180))

    for stream in (first, again):
        assert [m.HasField("usage") for m in stream] == [False] * (len(stream) - 1) + [True]
        assert stream[-1].finish_reason == "length"
        assert len([t for m in stream for t in m.token_ids]) == MAX_TOKENS
    assert usage(first[-1]) == (40, MAX_TOKENS, 0)
    assert usage(again[-1]) == (40, MAX_TOKENS, cached_when_repeated)
    assert usage(unary) == (40, len(unary.completions[0].token_ids), cached_when_repeated)
    assert usage(text[-1])[:2] == (len(smollm2_tokenizer().encode(TEXT[:40])), 3)
