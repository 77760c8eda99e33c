"""The public gRPC API's front door: API key, undecodable bytes, 0 versus unset, size, health."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from router.api.grpc_api import SERVICE_NAME, start_grpc_server
from router.cluster.readiness import Readiness
from tests.unit.router_doubles import ScriptedBackend, make_service, token_steps

PARIS = (7042, 314, 9239, 30, 378, 1112)  # " Paris", " is", " nice", ".", " The", " end"
KEY = "s3cret-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
GENERATE = generation_pb2.GenerateRequest(
    text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))


def serve(check, *, api_key=KEY, script=None, max_message_bytes=2 * 1024 * 1024, readiness=None):
    """Run `check(stub, channel, backend)` against a real in-process gRPC server."""
    backend = ScriptedBackend(script or token_steps(PARIS[:2]))

    async def go():
        door = await start_grpc_server(make_service(backend), "127.0.0.1", 0, api_key=api_key,
                                       max_message_bytes=max_message_bytes, readiness=readiness,
                                       readiness_interval_s=0.05)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{door.port}") as channel:
                return await check(generation_pb2_grpc.GenerationStub(channel), channel, backend)
        finally:
            await door.stop(grace=0)

    return asyncio.run(go())


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def stream_code(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_generation_method_without_the_key_is_unauthenticated():
    async def check(stub, _, backend):
        return [
            await code_of(stub.Generate(GENERATE)),
            await stream_code(stub.GenerateStream(GENERATE)),
            await code_of(stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"))),
            await code_of(stub.ListModels(generation_pb2.ListModelsRequest())),
            await code_of(stub.ListModels(generation_pb2.ListModelsRequest(),
                                          metadata=(("authorization", "Bearer wrong"),))),
            await code_of(stub.ListModels(generation_pb2.ListModelsRequest(),
                                          metadata=(("authorization", KEY),))),
            len(backend.requests),
        ]

    assert serve(check) == [grpc.StatusCode.UNAUTHENTICATED] * 6 + [0]


def test_the_right_key_is_served_and_health_stays_open():
    async def check(stub, channel, _):
        reply = await stub.Generate(GENERATE, metadata=AUTH)
        models = await stub.ListModels(generation_pb2.ListModelsRequest(), metadata=(("authorization", f"bearer {KEY}"),))
        health = health_pb2_grpc.HealthStub(channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        return list(reply.completions[0].token_ids), models.models[0].id, status.status

    assert serve(check) == (list(PARIS[:2]), "SmolLM2-135M-Instruct", health_pb2.HealthCheckResponse.SERVING)


def test_garbage_bytes_are_invalid_argument_not_unknown():
    async def check(_, channel, backend):
        raw = channel.unary_unary(f"/{SERVICE_NAME}/Generate", request_serializer=None,
                                  response_deserializer=None)
        raw_stream = channel.unary_stream(f"/{SERVICE_NAME}/GenerateStream", request_serializer=None,
                                          response_deserializer=None)
        garbage = b"\xff\xff\xff\xff\x0f not a message"
        return (await code_of(raw(garbage, metadata=AUTH)),
                await stream_code(raw_stream(garbage, metadata=AUTH)), len(backend.requests))

    assert serve(check) == (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, 0)


def test_top_p_zero_and_n_zero_are_invalid_argument_while_unset_means_the_default():
    def request(**sampling):
        return generation_pb2.GenerateRequest(
            text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, **sampling))

    async def check(stub, _, backend):
        codes = [await code_of(stub.Generate(request(top_p=0.0), metadata=AUTH)),
                 await code_of(stub.Generate(request(n=0), metadata=AUTH)),
                 await code_of(stub.Generate(request(repetition_penalty=0.0), metadata=AUTH))]
        await stub.Generate(request(), metadata=AUTH)
        return codes, backend.requests

    codes, requests = serve(check)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert len(requests) == 1
    params = requests[0].params
    assert (params.n, params.temperature, params.top_p, params.repetition_penalty) == (1, 1.0, 1.0, 1.0)


def test_limits_hold_over_grpc_too():
    async def check(stub, _, backend):
        many_n = generation_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(n=129))
        many_stops = generation_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(stop=["x"] * 65))
        huge = generation_pb2.GenerateRequest(text="a" * 5000)
        return ([await code_of(stub.Generate(many_n, metadata=AUTH)),
                 await code_of(stub.Generate(many_stops, metadata=AUTH)),
                 await code_of(stub.Generate(huge, metadata=AUTH))], len(backend.requests))

    codes, sent = serve(check, max_message_bytes=4096)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert sent == 0


def test_the_client_request_id_is_echoed_but_not_the_backend_key():
    async def check(stub, _, backend):
        msg = generation_pb2.GenerateRequest(text="Hello", request_id="mine",
                                             sampling=common_pb2.SamplingParams(max_tokens=2))
        first, second = await asyncio.gather(stub.Generate(msg, metadata=AUTH), stub.Generate(msg, metadata=AUTH))
        return first.request_id, second.request_id, sorted(r.request_id for r in backend.requests)

    assert serve(check) == ("mine", "mine", ["b1-0", "b2-0"])


def test_health_follows_readiness_for_the_service_and_overall():
    state = {"ready": False}

    async def readiness():
        return Readiness(state["ready"], "ready" if state["ready"] else "not ready: no decode worker", 1, 0)

    async def check(_, channel, __):
        health = health_pb2_grpc.HealthStub(channel)

        async def statuses():
            return [(await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                    for name in ("", SERVICE_NAME)]

        before = await statuses()
        state["ready"] = True
        for _ in range(100):  # the follower refreshes every 0.05 s; bounded wait of 5 s
            await asyncio.sleep(0.05)
            if await statuses() == [health_pb2.HealthCheckResponse.SERVING] * 2:
                break
        return before, await statuses()

    before, after = serve(check, readiness=readiness)
    assert before == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
    assert after == [health_pb2.HealthCheckResponse.SERVING] * 2
