"""The OpenAI-compatible HTTP API (vLLM's surface) over a RouterService.

Handlers are thin: FastAPI decodes the body, the handler calls one service method, and
router.api.openai_encode shapes the JSON. The generation routes' handlers live in
router.api.generation_routes, whose fast path answers well-formed generation requests
without FastAPI (inside the guards); anything else reaches the routes here. RouterErrors become HTTP responses in `http_guards.error_response`
only. Three ASGI guards (router.api.http_guards) wrap every route: the request id (X-Request-Id
echoed, or a new uuid), the API key check (all routes but /health and /ready) and the body size
limit. Framework refusals (unknown route, wrong method, a body that is not JSON) get vLLM's
error shape too, never FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from router.errors import (
    HttpStatusError,
    InvalidRequest,
    Overloaded,
    RouterError,
    internal_error,
)
from router.api.generation_routes import (
    CLIENT_CLOSED_REQUEST,
    ClientDisconnected,
    GenerationFastPath,
    chat_completion,
    completion,
    is_json,
)
from router.serving.metrics import PROMETHEUS_CONTENT_TYPE
from router.api.openai_encode import detokenize_body, models_body, tokenize_body
from router.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from router.api.http_guards import (
    AdminGuardMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    error_response,
)
from router.ops.access import AdminAccess
from router.ops.admin_http import admin_routes
from router.ops.roles import RolesApi
from router.ops.roles_metrics import RolesCollector
from router.cluster.readiness import Readiness
from router.api.validation import DEFAULT_MAX_REQUEST_BYTES
from router.serving.service import RouterService


def _pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class HttpSettings:
    """How the HTTP front door behaves (the service holds everything about the model)."""

    api_key: str | None = None
    """When set, every route but /health, /ready and the dashboard's shell (router.ops.dashboard.paths)
    requires `Authorization: Bearer <api_key>`."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body accepted; larger ones get 413 before they are read."""
    readiness: Callable[[], Awaitable[Readiness]] | None = None
    """Whether workers can serve now (/ready); None: /ready answers as /health does."""
    version: str = field(default_factory=_pdserve_version)
    """Reported by /version."""
    cluster_view: Callable[[], Awaitable[dict[str, object]]] | None = None
    """Builds the JSON of /v1/cluster (the service-wide KV view); None: the route answers 404."""
    roles: RolesApi | None = None
    """Serves /v1/roles and /v1/workers/{id}/drain; None: those routes answer 404."""
    admin_access: AdminAccess | None = None
    """Who may read and change the roles; required with `roles`."""
    ops_routes: tuple[APIRouter, ...] = ()
    """The ops pages and data (dashboard, timelines, planner), included after the API's routes;
    the same guards decide access (router.ops.access)."""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key required)")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if (self.roles is None) != (self.admin_access is None):
            raise ValueError("roles and admin_access go together: the roles routes need their guard")


_NO_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                 if "telemetry" in inspect.signature(FastAPI).parameters else {})
"""FastAPI >= 0.16x checks OpenTelemetry providers on every request (environment reads, ~2% of
the router's CPU under load); the router exports Prometheus metrics instead."""


class RouterApp(FastAPI):
    """FastAPI with the guards outside its own middleware (error page, telemetry, body size):
    a well-formed generation request passes the guards and the fast path only, not three more
    layers whose wrappers every one of its ASGI messages went through (FastAPI 0.16x added two
    of them). Its bugs get the error page's answer from the fast path itself. add_guard()
    stacks like add_middleware: the last added runs first."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guards: list[Middleware] = []

    def add_guard(self, cls: Any, **options: Any) -> None:
        if self.middleware_stack is not None:
            raise RuntimeError("guards are added before the app serves its first request")
        self.guards.insert(0, Middleware(cls, **options))

    def build_middleware_stack(self) -> ASGIApp:
        app = super().build_middleware_stack()
        for cls, args, kwargs in reversed(self.guards):
            app = cls(app, *args, **kwargs)
        return app


def create_app(service: RouterService, settings: HttpSettings | None = None) -> RouterApp:
    """The app serving `service`. Each app has its own metrics registry (the service's)."""
    settings = settings or HttpSettings()
    app = RouterApp(title="pdserve router", version=settings.version, **_NO_TELEMETRY)
    # Starlette types handlers for plain Exception; these take the subclass they handle.
    app.add_exception_handler(RouterError, _on_router_error)  # type: ignore[arg-type]
    app.add_exception_handler(
        RequestValidationError, _on_validation_error  # type: ignore[arg-type]
    )
    app.add_exception_handler(HTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
    app.add_exception_handler(Exception, _on_unexpected_error)
    app.include_router(_routes(service, settings))
    # Innermost of the guards below: well-formed generation requests skip FastAPI (generation_routes.py).
    app.add_guard(GenerationFastPath, service=service)
    if settings.roles is not None:
        app.include_router(admin_routes(settings.roles))
        # Beside the route that refreshes its view before each scrape (see /metrics).
        service.metrics.registry.register(RolesCollector(settings.roles))
    for routes in settings.ops_routes:
        app.include_router(routes)
    # The last added runs first: id (so every refusal carries it), admin access, key, then body
    # size (so an unauthenticated client cannot make the router buffer a body).
    app.add_guard(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_guard(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.admin_access is not None:
        app.add_guard(AdminGuardMiddleware, access=settings.admin_access)
    app.add_guard(RequestIdMiddleware)
    return app


def _routes(service: RouterService, settings: HttpSettings) -> APIRouter:
    api = APIRouter()

    @api.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @api.get("/ready")
    async def ready() -> Response:
        if settings.readiness is None:
            return JSONResponse({"status": "ready"})
        state = await settings.readiness()
        if not state.ready:
            raise Overloaded(state.reason)
        return JSONResponse({"status": "ready", "prefill_workers": state.prefill_workers,
                             "decode_workers": state.decode_workers})

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
        if settings.roles is not None:
            await settings.roles.refresh()  # the role gauges read its last view
        return Response(service.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @api.post("/tokenize", dependencies=[Depends(_json_body)])
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        return JSONResponse(tokenize_body(await service.tokenize(body)))

    @api.post("/detokenize", dependencies=[Depends(_json_body)])
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(detokenize_body(await service.detokenize(body)))

    @api.post("/v1/completions", dependencies=[Depends(_json_body)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await completion(service, body, request_id(request), request.receive, request.headers)

    @api.post("/v1/chat/completions", dependencies=[Depends(_json_body)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_completion(service, body, request_id(request), request.receive, request.headers)

    return api


async def _json_body(request: Request) -> None:
    """vLLM's check: POST bodies must be declared JSON (400 otherwise, with vLLM's message).
    async: FastAPI runs a plain `def` dependency in a thread, a hop that cost every request."""
    if not is_json(request.headers.get("content-type")):
        raise InvalidRequest("Unsupported Media Type: Only 'application/json' is allowed")


def request_id(request: Request) -> str:
    """The id RequestIdMiddleware gave this request."""
    return request.scope["state"]["request_id"]


async def _on_router_error(_: Request, exc: RouterError) -> JSONResponse:
    return error_response(exc)


async def _on_http_exception(_: Request, exc: HTTPException) -> JSONResponse:
    # 404/405 from routing, and FastAPI's "There was an error parsing the body" (a body that is
    # not UTF-8, or JSON nested past the parser's recursion limit).
    response = error_response(HttpStatusError(exc.status_code, str(exc.detail)))
    response.headers.update(exc.headers or {})
    return response


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems, param = [], None
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "")
            problems.append(f"JSON decode error: {reason}".rstrip(": "))
            continue
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        param = param or (".".join(loc) or None)
        problems.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return error_response(InvalidRequest("; ".join(problems), param=param))


async def _on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    # A bug: answer in the usual shape; Starlette re-raises it afterwards, so it gets logged.
    return error_response(internal_error(exc))


async def _on_client_disconnected(_: Request, __: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
