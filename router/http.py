"""The OpenAI-compatible HTTP API (vLLM's surface) over a RouterService.

Handlers are thin: FastAPI decodes the body, the handler calls one service method, and
router.openai_encode shapes the JSON. RouterErrors become HTTP responses in `_error_response`
only. Two ASGI middlewares wrap every route: the request id (X-Request-Id echoed, or a new
uuid) and the API key check (all routes but /health).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.metadata
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import InvalidRequest, RouterError, Unauthorized, WorkerFailure, http_error
from router.event_stream import EventStreamResponse, wait_for_disconnect
from router.metrics import PROMETHEUS_CONTENT_TYPE
from router.openai_encode import (
    ChatChunks,
    ChunkEncoder,
    CompletionChunks,
    chat_body,
    completion_body,
    detokenize_body,
    models_body,
    sse_lines,
    tokenize_body,
)
from router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from router.results import ResponseHead
from router.service import ResponseStream, RouterService

T = TypeVar("T")
PATH_HEADER = "x-pdserve-path"
ROUTE_HEADER = "x-pdserve-route"
REQUEST_ID_HEADER = "x-request-id"
# Not an HTTP standard: nginx's "client closed request", logged when a client leaves mid-way.
CLIENT_CLOSED_REQUEST = 499


def _pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class HttpSettings:
    """How the HTTP front door behaves (the service holds everything about the model)."""

    api_key: str | None = None
    """When set, every route but /health requires `Authorization: Bearer <api_key>`."""
    version: str = field(default_factory=_pdserve_version)
    """Reported by /version."""
    cluster_view: Callable[[], Awaitable[dict[str, object]]] | None = None
    """Builds the JSON of /v1/cluster (the service-wide KV view); None: the route answers 404."""


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def create_app(service: RouterService, settings: HttpSettings | None = None) -> FastAPI:
    """The FastAPI app serving `service`. Each app has its own metrics registry (the service's)."""
    settings = settings or HttpSettings()
    app = FastAPI(title="pdserve router", version=settings.version)
    # Starlette types handlers for plain Exception; these take the subclass they handle.
    app.add_exception_handler(RouterError, _on_router_error)  # type: ignore[arg-type]
    app.add_exception_handler(
        RequestValidationError, _on_validation_error  # type: ignore[arg-type]
    )
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
    app.add_exception_handler(Exception, _on_unexpected_error)
    app.include_router(_routes(service, settings))
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(RequestIdMiddleware)  # added last = outermost: 401s carry the id too
    return app


def _routes(service: RouterService, settings: HttpSettings) -> APIRouter:
    api = APIRouter()

    @api.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @api.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": settings.version})

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_body(service.model_card()))

    @api.get("/v1/cluster")
    async def cluster() -> JSONResponse:
        if settings.cluster_view is None:
            return JSONResponse({"error": {"message": "this router has no cluster view", "type": "NotFoundError",
                                           "param": None, "code": 404}}, status_code=404)
        return JSONResponse(await settings.cluster_view())

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        return JSONResponse(tokenize_body(service.tokenize(body)))

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(detokenize_body(service.detokenize(body)))

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids, rid = bool(body.return_token_ids), request_id(request)
        if body.stream:
            stream = await _unless_disconnected(request, service.stream_complete(body, rid))
            return _event_stream(stream, CompletionChunks(stream, ids))
        result = await _unless_disconnected(request, service.complete(body, rid))
        return _json(completion_body(result, ids), result.head)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ids, rid = bool(body.return_token_ids), request_id(request)
        if body.stream:
            stream = await _unless_disconnected(request, service.stream_chat(body, rid))
            return _event_stream(stream, ChatChunks(stream, ids))
        result = await _unless_disconnected(request, service.chat(body, rid))
        return _json(chat_body(result, ids), result.head)

    return api


def request_id(request: Request) -> str:
    """The id RequestIdMiddleware gave this request."""
    return request.scope["state"]["request_id"]


def _path_headers(head: ResponseHead) -> dict[str, str]:
    headers = {} if head.path is None else {PATH_HEADER: head.path}
    if head.route is not None:
        headers[ROUTE_HEADER] = head.route
    return headers


def _json(body: object, head: ResponseHead) -> JSONResponse:
    return JSONResponse(body, headers=_path_headers(head))


def _event_stream(stream: ResponseStream, chunks: ChunkEncoder) -> EventStreamResponse:
    return EventStreamResponse(
        sse_lines(stream, chunks), stream.aclose, headers=_path_headers(stream.head)
    )


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (the service then aborts the backend) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def _error_response(error: RouterError) -> JSONResponse:
    """The one place a RouterError becomes an HTTP response."""
    mapped = http_error(error)
    return JSONResponse(mapped.body(), status_code=mapped.status_code, headers=dict(mapped.headers))


async def _on_router_error(_: Request, exc: RouterError) -> JSONResponse:
    return _error_response(exc)


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems, param = [], None
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        param = param or (".".join(loc) or None)
        problems.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return _error_response(InvalidRequest("; ".join(problems), param=param))


async def _on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    # A bug: answer in the usual shape; Starlette re-raises it afterwards, so it gets logged.
    return _error_response(WorkerFailure(f"internal router error ({type(exc).__name__})"))


async def _on_client_disconnected(_: Request, __: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


class RequestIdMiddleware:
    """Gives each request an id (its X-Request-Id, or a new uuid) and echoes it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <api_key>` (every path but /health)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await _error_response(Unauthorized())(scope, receive, send)

    @staticmethod
    def _is_open(scope: Scope) -> bool:
        # CORS preflights carry no credentials; /health is for load balancers and probes.
        return scope["path"] == "/health" or scope.get("method") == "OPTIONS"

    def _allowed(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # Compare fixed-length digests so timing reveals nothing about the key.
        given = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest)
