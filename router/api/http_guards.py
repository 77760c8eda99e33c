"""The HTTP front door's guards, run before any route: request id, admin access, API key, body size.

Each is a plain ASGI middleware so it acts before FastAPI reads or parses the body. RouterErrors
become responses in `error_response` only (the HTTP half of the one error mapping).
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api.api_key import ApiKey
from router.errors import PayloadTooLarge, RouterError, Unauthorized, http_error
from router.ops.access import AdminAccess, admin_route_access
from router.ops.dashboard.paths import is_shell as is_dashboard_shell
from router.serving.types import random_id

REQUEST_ID_HEADER = "x-request-id"
OPEN_PATHS = frozenset({"/health", "/ready"})
"""Probes for load balancers and orchestrators: no credentials, no request data."""


class ErrorJSONResponse(JSONResponse):
    """JSON escaped to ASCII: an error may quote client text that is not valid Unicode."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(error: RouterError) -> JSONResponse:
    """The one place a RouterError becomes an HTTP response."""
    mapped = http_error(error)
    return ErrorJSONResponse(
        mapped.body(), status_code=mapped.status_code, headers=dict(mapped.headers)
    )


class RequestIdMiddleware:
    """Gives each request an id (its X-Request-Id, or a new uuid) and echoes it back. The id is
    the client's label only: the service names backend requests itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get(REQUEST_ID_HEADER) or random_id()
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


class ResponseHeaderMiddleware:
    """Adds one fixed header to every response (which of a router's processes answered)."""

    def __init__(self, app: ASGIApp, name: str, value: str) -> None:
        self.app = app
        self._header = (name.lower().encode("latin-1"), value.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class AdminGuardMiddleware:
    """Decides the roles and drain routes (router.ops.access): reads need the API key (or the
    admin key), changes the admin key; other paths pass on to the API key guard."""

    def __init__(self, app: ASGIApp, access: AdminAccess) -> None:
        self.app = app
        self._access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = admin_route_access(scope.get("method", ""), scope["path"]) if scope["type"] == "http" else None
        if kind is not None:
            refusal = self._access.refusal(kind, Headers(scope=scope).get("authorization"))
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
            scope.setdefault("state", {})["admin_checked"] = True
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <api_key>` (every path but the probes, the
    dashboard's shell (page and static files, which hold no data), and the admin routes
    AdminGuardMiddleware has already let through with the admin key)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = ApiKey(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope) or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await error_response(Unauthorized())(scope, receive, send)

    @staticmethod
    def _is_open(scope: Scope) -> bool:
        # CORS preflights carry no credentials.
        if scope.get("state", {}).get("admin_checked"):
            return True
        if is_dashboard_shell(scope.get("method", ""), scope["path"]):
            return True
        return scope["path"] in OPEN_PATHS or scope.get("method") == "OPTIONS"

    def _allowed(self, scope: Scope) -> bool:
        return self._key.allows(Headers(scope=scope).get("authorization"))


class BodyLimitMiddleware:
    """Answers 413 for a body over `max_bytes`, from Content-Length before reading anything, or
    as soon as a chunked body passes the limit; the app then gets the body replayed at once, so
    nothing downstream ever holds more than `max_bytes` of one request."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(int(length), scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(None, scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, replay_body(bytes(body), receive), send)

    async def _refuse(self, length: int | None, scope: Scope, receive: Receive, send: Send) -> None:
        size = f"{length:,} bytes" if length is not None else f"more than {self.max_bytes:,} bytes"
        error = PayloadTooLarge(
            f"The request body is {size}; this server accepts at most {self.max_bytes:,} bytes "
            "(--max-request-bytes)."
        )
        await error_response(error)(scope, receive, send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out `body` once, then the client's own messages (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
