"""GenerationFastPath (router/api/generation_routes.py): a well-formed generation request is
answered without reaching FastAPI, with the bytes FastAPI's route gives; anything else reaches
FastAPI with its body intact, so refusals keep their one shape."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from router.api.generation_routes import GenerationFastPath
from router.api.http import HttpSettings, create_app
from tests.unit.router_doubles import MODEL, ScriptedBackend, make_service, token_steps


class Inner:
    """What the fast path hands on to: FastAPI's stack, recording what reached it."""

    def __init__(self, app) -> None:
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        async def recording():
            message = await receive()
            if message["type"] == "http.request":
                self.bodies.append(message.get("body", b""))
            return message

        await self.app(scope, recording, send)


def serve(requests, fast: bool):
    """Each (path, kwargs) through the app with or without the fast path in front of FastAPI;
    (status, content-type, x-request-id, body text) per request, and the bodies FastAPI got."""
    async def go():
        service = make_service(ScriptedBackend(token_steps([19556, 30, 2])))
        stack = create_app(service, HttpSettings(version="9.9.9")).build_middleware_stack()
        parent = stack  # the guards, then the fast path, then FastAPI's own stack
        while not isinstance(parent.app, GenerationFastPath):
            parent = parent.app
        inner = parent.app.app = Inner(parent.app.app)
        if not fast:
            parent.app = inner  # the fast path taken out
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack), base_url="http://router") as client:
            for path, kwargs in requests:
                headers = {"x-request-id": "rid-1", **kwargs.pop("headers", {})}
                r = await client.post(path, headers=headers, **kwargs)
                out.append((r.status_code, r.headers.get("content-type"), r.headers.get("x-request-id"), r.text))
        return out, inner.bodies

    return asyncio.run(go())


WELL_FORMED = [
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0}}),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}}),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}}),
]


def test_well_formed_requests_never_reach_fastapi_and_get_fastapis_bytes():
    fast, reached = serve(WELL_FORMED, fast=True)
    slow, _ = serve(WELL_FORMED, fast=False)
    assert reached == []
    assert [r[:3] for r in fast] == [(200, "application/json", "rid-1"), (200, "text/event-stream; charset=utf-8", "rid-1"),
                                     (200, "text/event-stream; charset=utf-8", "rid-1")]
    strip = lambda text: json.dumps([json.loads(x) if x.startswith("{") else x for x in  # noqa: E731
                                     (text.replace("data: ", "").split("\n\n") if "data:" in text else [text])])
    assert [strip(r[3]) for r in fast] == [strip(r[3]) for r in slow]


@pytest.mark.parametrize("path, kwargs, status, fragment", [
    ("/v1/completions", {"content": b'{"model": "x", "prompt": ', "headers": {"content-type": "application/json"}},
     400, "JSON decode error"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "Hi", "max_tokens": "many"}}, 400, "max_tokens"),
    ("/v1/completions", {"json": [1, 2]}, 400, "body"),
    ("/v1/chat/completions", {"content": b"{}", "headers": {"content-type": "text/plain"}}, 400,
     "Only 'application/json' is allowed"),
    ("/v1/completions", {"json": {"model": "other", "prompt": "Hi"}}, 404, "does not exist"),
])  # fmt: skip
def test_refusals_keep_their_shape_and_fastapi_gets_the_body_whole(path, kwargs, status, fragment):
    (fast,), reached = serve([(path, dict(kwargs))], fast=True)
    (slow,), _ = serve([(path, dict(kwargs))], fast=False)
    assert fast == slow
    assert fast[0] == status and fragment in fast[3]
    assert fast[2] == "rid-1" and json.loads(fast[3])["error"]["code"] == status
    if status == 404:
        assert reached == []  # valid: the service refuses it on the fast path, in the same shape
    elif "content" in kwargs:
        assert reached == [kwargs["content"]]  # handed on whole (read or not)
    else:
        assert [json.loads(b) for b in reached] == [kwargs["json"]]
