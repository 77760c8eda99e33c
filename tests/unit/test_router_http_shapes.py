"""Every refusal, the framework's included, in vLLM's error shape; never FastAPI's {"detail"}."""

from __future__ import annotations

import pytest

from tests.unit.router_doubles import call, make_app, token_steps

KEY = "k"
AUTH = {"authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}


def error(message, type_, code, param=None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_an_unknown_route_is_a_404_in_vllm_shape():
    app, _ = make_app(token_steps([1]), api_key=KEY)
    response = call(app, "GET", "/v2/nothing", headers=AUTH)
    assert response.status_code == 404
    assert response.json() == error("Not Found", "Not Found", 404)


def test_a_wrong_method_is_a_405_in_vllm_shape_with_allow():
    app, _ = make_app(token_steps([1]), api_key=KEY)
    response = call(app, "GET", "/v1/completions", headers=AUTH)
    assert response.status_code == 405
    assert response.json() == error("Method Not Allowed", "Method Not Allowed", 405)
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize(("body", "message", "type_"), [
    (b'{"prompt": "a"', "JSON decode error: Expecting ',' delimiter", "BadRequestError"),
    (b'{"prompt": "\xff\xfe"}', "There was an error parsing the body", "Bad Request"),
    (b"[" * 100_000 + b"]" * 100_000, "There was an error parsing the body", "Bad Request"),
    (b"[1, 2]", "body: Input should be a valid dictionary or object to extract fields from",
     "BadRequestError"),
    (b'"just a string"', "body: Input should be a valid dictionary or object to extract fields from",
     "BadRequestError"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_in_vllm_shape(body, message, type_):
    app, backend = make_app(token_steps([1]), api_key=KEY)
    response = call(app, "POST", "/v1/completions", content=body, headers=JSON)
    assert response.status_code == 400
    assert response.json() == error(message, type_, 400)
    assert backend.requests == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_json_is_a_400_with_vllms_message(content_type):
    app, backend = make_app(token_steps([1]), api_key=KEY)
    headers = dict(AUTH) | ({"content-type": content_type} if content_type else {})
    response = call(app, "POST", "/v1/chat/completions", content=b'{"messages": []}', headers=headers)
    assert response.status_code == 400
    assert response.json() == error(
        "Unsupported Media Type: Only 'application/json' is allowed", "BadRequestError", 400)
    assert backend.requests == []


def test_json_with_a_charset_parameter_is_accepted():
    app, _ = make_app(token_steps([7042]), api_key=KEY)
    headers = {**AUTH, "content-type": "application/json; charset=utf-8"}
    response = call(app, "POST", "/v1/completions", content=b'{"prompt": "Hello", "max_tokens": 1}',
                    headers=headers)
    assert response.status_code == 200


def test_an_unauthenticated_unknown_route_is_a_401_not_a_404():
    app, _ = make_app(token_steps([1]), api_key=KEY)
    response = call(app, "GET", "/v2/nothing")
    assert response.status_code == 401
    assert response.json() == error("Unauthorized", "AuthenticationError", 401)


def test_sse_chunks_are_compact_utf8_json_and_text_that_is_not_unicode_is_escaped():
    from router.api.openai_encode import dumps, sse

    assert sse({"text": "é", "n": 1.5}) == 'data: {"text":"é","n":1.5}\n\n'.encode()
    assert dumps({"text": "a\ud800b"}) == b'{"text":"a\\ud800b"}'
