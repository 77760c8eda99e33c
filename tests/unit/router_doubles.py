"""A scripted GenerationBackend for testing the router without a model, plus helpers.

`ScriptedBackend` is a test double, not an engine: it replays pre-set token deltas (or raises
pre-set errors) and records what the router asked of it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from fastapi import FastAPI

from engine.loader.locate import default_model_path
from engine.tokenizer import Tokenizer, load_tokenizer
from router.serving.backend import BackendRequest, TokenDelta
from router.api.http import HttpSettings, create_app
from router.serving.service import RouterService

Step = TokenDelta | Exception  # an exception is raised where it stands in the script
Script = Sequence[Step] | Callable[[BackendRequest], Sequence[Step]]

MODEL = "SmolLM2-135M-Instruct"
PATH = "disaggregated"


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """The real default-model tokenizer (loaded once per test process)."""
    return load_tokenizer(default_model_path())


class ScriptedBackend:
    """Replays a script per backend request; records requests, aborts and closed streams.

    With `hold_after=k`, each stream stops after its k-th step until `release` is set (or
    forever), to test what happens to a request still generating.
    """

    def __init__(self, script: Script, hold_after: int | None = None) -> None:
        self._script = script
        self._hold_after = hold_after
        self.release = asyncio.Event()
        self.requests: list[BackendRequest] = []
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.holding = asyncio.Event()

    async def generate(self, request: BackendRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        steps = self._script(request) if callable(self._script) else self._script
        try:
            for k, step in enumerate(steps):
                if k == self._hold_after:
                    self.holding.set()
                    await self.release.wait()
                if isinstance(step, Exception):
                    raise step
                yield step
        finally:
            self.closed.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def token_steps(
    ids: Sequence[int],
    finish_reason: str = "length",
    stop_token_id: int | None = None,
    path: str | None = PATH,
    per_delta: int = 1,
) -> list[TokenDelta]:
    """`ids` as deltas of `per_delta` tokens, the last one finishing."""
    chunks = [tuple(ids[i : i + per_delta]) for i in range(0, len(ids), per_delta)]
    return [
        TokenDelta(
            token_ids=chunk,
            finish_reason=finish_reason if k == len(chunks) - 1 else None,
            stop_token_id=stop_token_id if k == len(chunks) - 1 else None,
            path=path,
        )
        for k, chunk in enumerate(chunks)
    ]


def sse_payloads(body: str) -> list[dict | str]:
    """The JSON objects of an SSE body, in order; "[DONE]" stays a string."""
    assert body.endswith("\n\n"), f"SSE body must end with a blank line: {body[-20:]!r}"
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"not an SSE data line: {block!r}"
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


CREATED = 1_700_000_000
MODEL_ROOT = "/models/SmolLM2-135M-Instruct.gguf"


def make_service(backend: ScriptedBackend, max_model_len: int = 2048, **kwargs) -> RouterService:
    """A RouterService over `backend` with fixed clocks (so bodies are exact) and backend
    request ids b1, b2, ... in the order requests start."""
    ids = itertools.count(1)
    kwargs.setdefault("new_request_id", lambda: f"b{next(ids)}")
    return RouterService(
        smollm2_tokenizer(),
        backend,
        MODEL,
        max_model_len,
        model_root=MODEL_ROOT,
        clock=lambda: 0.0,
        wall_clock=lambda: float(CREATED),
        **kwargs,
    )


def make_app(
    script: Script, api_key: str | None = None, **kwargs
) -> tuple[FastAPI, ScriptedBackend]:
    """The HTTP app over a ScriptedBackend; `hold_after` goes to the backend, the rest to
    make_service."""
    backend = ScriptedBackend(script, hold_after=kwargs.pop("hold_after", None))
    settings = HttpSettings(api_key=api_key, version="9.9.9")
    app = create_app(make_service(backend, **kwargs), settings)
    return app, backend


def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    """One request through the ASGI app in-process (the body is read in full)."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())
