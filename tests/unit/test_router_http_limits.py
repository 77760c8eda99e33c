"""Limits checked before any work: nothing reaches the backend, and the answer is a 4xx."""

from __future__ import annotations

import json

import pytest

from router.api.http import HttpSettings, create_app
from router.api.validation import RequestLimits
from tests.unit.router_doubles import ScriptedBackend, call, make_service, token_steps

JSON = {"content-type": "application/json"}


def app_and_backend(max_request_bytes=2 * 1024 * 1024, **limits):
    backend = ScriptedBackend(token_steps([7042]))
    service = make_service(backend, limits=RequestLimits(**limits))
    return create_app(service, HttpSettings(max_request_bytes=max_request_bytes)), backend


def post(app, body, path="/v1/completions"):
    # json.dumps escapes lone surrogates ("\ud800"), which httpx's own encoder refuses to send.
    return call(app, "POST", path, content=json.dumps(body).encode(), headers=JSON)


def bad(message, param=None, code=400, type_="BadRequestError"):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_a_body_over_the_limit_is_a_413_from_content_length():
    app, backend = app_and_backend(max_request_bytes=1000)
    response = call(app, "POST", "/v1/completions", content=b"x" * 1001, headers=JSON)
    assert response.status_code == 413
    assert response.json() == bad(
        "The request body is 1,001 bytes; this server accepts at most 1,000 bytes "
        "(--max-request-bytes).", code=413, type_="Request Entity Too Large")
    assert backend.requests == []


def test_a_chunked_body_over_the_limit_is_a_413_without_reading_it_all():
    app, backend = app_and_backend(max_request_bytes=1000)
    sent = []

    async def chunks():
        for _ in range(100):
            sent.append(1)
            yield b"x" * 100

    response = call(app, "POST", "/v1/completions", content=chunks(), headers=JSON)
    assert response.status_code == 413
    assert response.json()["error"]["message"] == (
        "The request body is more than 1,000 bytes; this server accepts at most 1,000 bytes "
        "(--max-request-bytes).")
    assert len(sent) < 100
    assert backend.requests == []


def test_a_body_at_the_limit_is_served():
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    app, backend = app_and_backend(max_request_bytes=len(body))
    response = call(app, "POST", "/v1/completions", content=body, headers=JSON)
    assert response.status_code == 200
    assert len(backend.requests) == 1


@pytest.mark.parametrize(("field", "message", "param"), [
    ({"n": 1_000_000}, "n must be at most 128, got 1000000.", "n"),
    ({"n": 100, "prompt": ["a"] * 11},
     "This request asks for 1100 sequences (11 prompts x n=100); at most 1024 are allowed per request.", "n"),
    ({"stop": ["x"] * 65}, "stop may hold at most 64 strings, got 65.", "stop"),
    ({"stop": "y" * 1025}, "each stop string may be at most 1024 characters, got one of 1025.", "stop"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids may hold at most 1024 ids, got 1025.", "stop_token_ids"),
    ({"top_k": 2**31}, "top_k: Input should be less than or equal to 2147483647", "top_k"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids.0: Input should be less than or equal to 2147483647",
     "stop_token_ids.0"),
    ({"max_tokens": 2**31}, "max_tokens: Input should be less than or equal to 2147483647", "max_tokens"),
    ({"logprobs": 2**32}, "logprobs: Input should be less than or equal to 2147483647", "logprobs"),
    ({"min_tokens": -(2**31) - 1}, "min_tokens: Input should be greater than or equal to -2147483648",
     "min_tokens"),
    ({"seed": 2**63}, "seed: Input should be less than or equal to 9223372036854775807", "seed"),
    ({"prompt": [2**31]}, "prompt.list[constrained-int].0: Input should be less than or equal to 2147483647",
     "prompt.list[constrained-int].0"),
    ({"prompt": "\ud800"},
     "prompt: Value error, text must be valid Unicode: it holds a lone surrogate (e.g. \\ud800)", "prompt"),
    ({"stop": ["\udfff"]},
     "stop: Value error, text must be valid Unicode: it holds a lone surrogate (e.g. \\ud800)", "stop"),
])
def test_a_completion_over_a_limit_is_a_400_naming_the_field(field, message, param):
    app, backend = app_and_backend()
    response = post(app, {"prompt": "Hello", **field})
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["message"].startswith(message)
    assert body["error"]["param"] == param
    assert backend.requests == []


def test_a_chat_with_a_lone_surrogate_in_a_message_is_a_400():
    app, backend = app_and_backend()
    response = post(app, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "/v1/chat/completions")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.content"
    assert backend.requests == []


def test_n_at_the_limit_is_served_as_that_many_sequences():
    app, backend = app_and_backend(max_n=3)
    response = post(app, {"prompt": "Hello", "n": 3, "max_tokens": 1})
    assert response.status_code == 200
    assert [r.request_id for r in backend.requests] == ["b1-0", "b1-1", "b1-2"]
    assert post(app, {"prompt": "Hello", "n": 4}).json() == bad("n must be at most 3, got 4.", "n")


def test_a_surrogate_pair_spelled_in_json_is_valid_text():
    app, backend = app_and_backend()
    response = call(app, "POST", "/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers=JSON)
    assert response.status_code == 200
    assert response.json()["count"] >= 1
