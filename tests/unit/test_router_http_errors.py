"""Errors through the HTTP app: vLLM's JSON shape before a stream starts, in-band after."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.errors import Overloaded, WorkerFailure
from tests.unit.router_doubles import call, make_app, sse_payloads, token_steps

ID = {"x-request-id": "req-1"}


def post(app, path="/v1/completions", **fields):
    return call(app, "POST", path, json={"prompt": "Hello", **fields}, headers=ID)


def error(message, type_="BadRequestError", param=None, code=400):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_negative_temperature_is_a_400_with_the_sampling_params_message():
    app, backend = make_app(token_steps([1]))
    response = post(app, temperature=-1)
    assert response.status_code == 400
    assert response.json() == error("temperature must be non-negative, got -1.0.")
    assert response.headers["x-request-id"] == "req-1"
    assert backend.requests == []


def test_a_field_of_the_wrong_type_is_a_400_naming_the_field():
    app, _ = make_app(token_steps([1]))
    response = post(app, max_tokens="many")
    assert response.status_code == 400
    assert response.json() == error(
        "max_tokens: Input should be a valid integer, unable to parse string as an integer",
        param="max_tokens",
    )


def test_unknown_model_is_a_404():
    app, _ = make_app(token_steps([1]))
    response = post(app, model="gpt-4")
    assert response.status_code == 404
    assert response.json() == error(
        "The model `gpt-4` does not exist.", "NotFoundError", "model", 404
    )


def test_overloaded_backend_is_a_503_with_retry_after():
    app, _ = make_app([Overloaded("no decode worker has 3 free blocks", retry_after_s=2)])
    response = post(app)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json() == error(
        "no decode worker has 3 free blocks", "ServiceUnavailableError", None, 503
    )


def test_overloaded_before_the_first_token_of_a_stream_is_still_a_503():
    app, _ = make_app([Overloaded("full", retry_after_s=1)])
    response = post(app, stream=True)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


def test_worker_failure_before_the_stream_starts_is_a_500_json_error():
    app, backend = make_app([WorkerFailure("prefill worker p0 died")])
    response = post(app, stream=True)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert response.json() == error("prefill worker p0 died", "InternalServerError", None, 500)
    assert backend.aborted == ["b1-0"]


def test_worker_failure_after_the_stream_started_arrives_in_band_then_done():
    steps = [*token_steps([7042], finish_reason=None), WorkerFailure("decode worker d1 died")]
    app, backend = make_app(steps)
    response = post(app, stream=True)
    assert response.status_code == 200
    events = sse_payloads(response.text)
    assert events[0]["choices"][0]["text"] == " Paris"
    assert events[1:] == [
        error("decode worker d1 died", "InternalServerError", None, 500),
        "[DONE]",
    ]
    assert backend.aborted == ["b1-0"]


def test_chat_worker_failure_after_start_arrives_in_band():
    steps = [*token_steps([19556], finish_reason=None), WorkerFailure("decode worker d1 died")]
    app, _ = make_app(steps)
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    events = sse_payloads(call(app, "POST", "/v1/chat/completions", json=body, headers=ID).text)
    failure = error("decode worker d1 died", "InternalServerError", None, 500)
    assert events[-2:] == [failure, "[DONE]"]


def test_a_backend_bug_after_the_stream_started_still_ends_the_stream_in_band():
    steps = [*token_steps([7042], finish_reason=None), KeyError("slot")]
    app, backend = make_app(steps)
    events = sse_payloads(post(app, stream=True).text)
    failure = error("internal router error (KeyError)", "InternalServerError", None, 500)
    assert events[1:] == [failure, "[DONE]"]
    assert backend.aborted == ["b1-0"]



def _post_raw(app, raise_app_exceptions: bool) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/completions", json={"prompt": "Hello"}, headers=ID)

    return asyncio.run(go())


def test_a_router_bug_before_the_response_is_a_500_in_the_usual_shape_and_still_raised():
    """The fast path answers outside FastAPI's error middleware: a bug there still gets the
    JSON 500 FastAPI's handler gives, with the request id, and still reaches the server's log."""
    app, _ = make_app([KeyError("slot")])
    response = _post_raw(app, raise_app_exceptions=False)
    assert response.status_code == 500
    assert response.json() == error("internal router error (KeyError)", "InternalServerError", None, 500)
    assert response.headers["x-request-id"] == "req-1"
    with pytest.raises(KeyError):
        _post_raw(app, raise_app_exceptions=True)
