"""Tools without a tool-call parser and empty `messages`: a 400 (INVALID_ARGUMENT) saying so.

vLLM (v0.11 protocol + serving_chat) without --enable-auto-tool-choice: tools sent with no
tool_choice mean "auto", which is refused with its message; tool_choice "none" is served (the
tools only reach the template); tool_choice without tools is refused. vLLM serves "required" and
named functions through structured outputs, which pdserve does not have: refused, saying so.
Nothing reaches the backend for a refused request.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from router.api.grpc_api import start_grpc_server
from tests.unit.router_doubles import ScriptedBackend, call, make_app, make_service, token_steps

PARIS = [7042, 314, 9239, 30]  # " Paris", " is", " nice", "."
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
AUTO_REFUSED = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
    '(pdserve has no tool-call parser yet: leave out `tools`, or send tool_choice "none")'
)
FORCED_REFUSED = (
    'tool_choice "required" or a named function needs structured outputs to force the call, '
    'which pdserve does not have yet: leave out `tools`, or send tool_choice "none"'
)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def post_chat(**fields):
    app, backend = make_app(token_steps(PARIS))
    response = call(app, "POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields})
    return response, backend


def error(message: str, param: str) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [WEATHER]}, AUTO_REFUSED),
        ({"tools": [WEATHER], "tool_choice": "auto"}, AUTO_REFUSED),
        ({"tools": [], "tool_choice": "auto"}, AUTO_REFUSED),
        ({"tools": [WEATHER], "tool_choice": "required"}, FORCED_REFUSED),
        ({"tools": [WEATHER], "tool_choice": NAMED}, FORCED_REFUSED),
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
         "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ],
)
def test_chat_asking_for_tool_calls_without_a_parser_is_a_400_saying_so(fields, message):
    response, backend = post_chat(**fields)
    assert (response.status_code, response.json()) == (400, error(message, "tool_choice"))
    assert backend.requests == []


def test_a_streamed_chat_with_tools_is_refused_before_the_stream_starts():
    response, backend = post_chat(tools=[WEATHER], stream=True)
    assert (response.status_code, response.json()) == (400, error(AUTO_REFUSED, "tool_choice"))
    assert backend.requests == []


def test_tools_with_tool_choice_none_are_served_as_vllm_does():
    response, backend = post_chat(tools=[WEATHER], tool_choice="none")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == " Paris is nice."
    assert len(backend.requests) == 1


def test_required_with_an_empty_tools_list_is_plain_chat_as_in_openai():
    response, backend = post_chat(tools=[], tool_choice="required")
    assert response.status_code == 200, response.text
    assert len(backend.requests) == 1


def test_empty_messages_is_a_400_naming_the_field():
    app, backend = make_app(token_steps(PARIS))
    for stream in (False, True):
        response = call(app, "POST", "/v1/chat/completions", json={"messages": [], "stream": stream})
        assert (response.status_code, response.json()) == (400, error(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
            "array instead.", "messages"))
    assert backend.requests == []


def test_empty_chat_over_grpc_is_invalid_argument_naming_the_field():
    backend = ScriptedBackend(token_steps(PARIS))
    empty = generation_pb2.GenerateRequest(chat=generation_pb2.ChatMessages(),
                                           sampling=common_pb2.SamplingParams(max_tokens=2))

    async def go():
        door = await start_grpc_server(make_service(backend), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{door.port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                errors = []
                for call_ in (stub.Generate(empty), _drain(stub.GenerateStream(empty))):
                    try:
                        await call_
                    except grpc.aio.AioRpcError as exc:
                        errors.append((exc.code(), exc.details()))
                return errors
        finally:
            await door.stop(grace=0)

    details = ("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an "
               "empty array instead.")
    assert asyncio.run(go()) == [(grpc.StatusCode.INVALID_ARGUMENT, details)] * 2
    assert backend.requests == []


async def _drain(stream) -> None:
    async for _ in stream:
        pass
