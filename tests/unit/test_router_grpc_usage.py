"""Usage over the public gRPC API, with a scripted backend: every stream's final message carries
it (with that completion's finish_reason), unary replies carry it, cached tokens included even
without --enable-prompt-tokens-details (HTTP keeps vLLM's rule: details only with the flag)."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from router.api.grpc_api import start_grpc_server
from tests.unit.router_doubles import (
    ScriptedBackend,
    call,
    make_app,
    make_service,
    smollm2_tokenizer,
    token_steps,
)

PARIS = (7042, 314, 9239, 30)  # " Paris", " is", " nice", "."
HELLO = generation_pb2.GenerateRequest(text="Hello world", sampling=common_pb2.SamplingParams(max_tokens=4))


def cached(steps, num_cached_tokens: int):
    """The scripted deltas, the first reporting a prefix-cache hit (as workers do)."""
    return [dataclasses.replace(steps[0], num_cached_tokens=num_cached_tokens), *steps[1:]]


def serve(script, check):
    backend = ScriptedBackend(script)

    async def go():
        door = await start_grpc_server(make_service(backend), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{door.port}") as channel:
                return await check(generation_pb2_grpc.GenerationStub(channel))
        finally:
            await door.stop(grace=0)

    return asyncio.run(go())


def usage(msg) -> tuple[int, int, int]:
    return msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens


def test_the_final_stream_message_carries_finish_reason_and_usage():
    async def check(stub):
        return [m async for m in stub.GenerateStream(HELLO)]

    messages = serve(cached(token_steps(PARIS), 1), check)
    prompt_len = len(smollm2_tokenizer().encode("Hello world"))
    assert [list(m.token_ids) for m in messages] == [[t] for t in PARIS]
    assert [m.HasField("usage") for m in messages] == [False, False, False, True]
    assert (messages[-1].finish_reason, usage(messages[-1])) == ("length", (prompt_len, 4, 1))
    assert "".join(m.text for m in messages) == " Paris is nice."


def test_every_completion_of_an_n_2_stream_finishes_and_only_the_last_message_has_usage():
    request = generation_pb2.GenerateRequest(
        text="Hello world", sampling=common_pb2.SamplingParams(max_tokens=2, n=2))

    async def check(stub):
        return [m async for m in stub.GenerateStream(request)]

    messages = serve(token_steps(PARIS[:2]), check)
    finished = sorted(m.index for m in messages if m.finish_reason == "length")
    assert finished == [0, 1]
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert usage(messages[-1]) == (2, 4, 0)


def test_a_unary_reply_carries_usage_with_cached_tokens():
    async def check(stub):
        return await stub.Generate(HELLO)

    reply = serve(cached(token_steps(PARIS), 1), check)
    assert usage(reply) == (2, 4, 1)
    assert list(reply.completions[0].token_ids) == list(PARIS)


def test_a_chat_stream_reports_the_templated_prompt_length():
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="Hi")]),
        sampling=common_pb2.SamplingParams(max_tokens=4))

    async def check(stub):
        return [m async for m in stub.GenerateStream(request)]

    messages = serve(token_steps(PARIS), check)
    assert usage(messages[-1]) == (31, 4, 0)  # SmolLM2's template around "Hi": 31 tokens


def test_http_usage_still_hides_cached_tokens_without_the_details_flag():
    app, _ = make_app(cached(token_steps(PARIS), 1))
    response = call(app, "POST", "/v1/completions", json={"prompt": "Hello world", "max_tokens": 4})
    assert response.json()["usage"] == {"prompt_tokens": 2, "total_tokens": 6, "completion_tokens": 4,
                                        "prompt_tokens_details": None}


def test_a_stream_failing_after_its_start_ends_with_the_error_not_with_usage():
    from router.errors import WorkerFailure

    async def check(stub):
        got = []
        try:
            async for m in stub.GenerateStream(HELLO):
                got.append(m)
        except grpc.aio.AioRpcError as exc:
            return got, exc.code(), exc.details()
        return got, grpc.StatusCode.OK, ""

    steps = token_steps(PARIS)
    got, code, details = serve([*steps[:2], WorkerFailure("decode-0 went away")], check)
    assert [list(m.token_ids) for m in got] == [[PARIS[0]], [PARIS[1]]]
    assert not any(m.HasField("usage") for m in got)
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "decode-0 went away")
