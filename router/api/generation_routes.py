"""The two generation routes (POST /v1/completions, /v1/chat/completions): their handlers, and
the fast path that serves a well-formed request without FastAPI.

FastAPI's routing, dependency injection and body handling cost ~0.45 ms of CPU per request
(an instant SSE endpoint: 0.63 ms through FastAPI against 0.17 ms as plain ASGI, both under
uvicorn), more than the rest of the router's own work per request. GenerationFastPath sits
inside the guards (request id, admin access, API key, body size: http_guards.py) and outside
FastAPI's own middleware (router.api.http.RouterApp), and answers a request whose content type
is JSON and whose body parses and validates, with the same handler FastAPI's route calls.
Anything else goes on to the FastAPI app with its body replayed, so every refusal (content
type, JSON, validation) keeps the one shape FastAPI's handlers give it; a bug gets the answer
FastAPI's error handler gives (a JSON 500) and is raised on to the server's log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import orjson
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.event_stream import ClientDisconnected, DisconnectWatch, EventStreamResponse
from router.api.http_guards import error_response, replay_body
from router.api.openai_encode import (
    TOKEN_TIMES_HEADER, ChatChunks, ChunkEncoder, CompletionChunks, WithTokenTimes, chat_body, completion_body,
    dumps, sse_lines)
from router.api.openai_models import ChatCompletionRequest, CompletionRequest
from router.errors import RouterError, internal_error
from router.serving.results import ResponseHead
from router.serving.service import ResponseStream, RouterService

__all__ = ["CLIENT_CLOSED_REQUEST", "ClientDisconnected", "GenerationFastPath", "chat_completion",
           "completion", "is_json", "PATH_HEADER", "ROUTE_HEADER"]

logger = logging.getLogger(__name__)
PATH_HEADER = "x-pdserve-path"
ROUTE_HEADER = "x-pdserve-route"
# Not an HTTP standard: nginx's "client closed request", logged when a client leaves mid-way.
CLIENT_CLOSED_REQUEST = 499


def is_json(content_type: str | None) -> bool:
    """vLLM's rule: POST bodies must be declared application/json."""
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


# ------------------------------------------------------------------ the handlers (both paths)
async def completion(service: RouterService, body: CompletionRequest, request_id: str, receive: Receive,
                     headers: Mapping[str, str]) -> Response:
    """POST /v1/completions: an SSE stream or one JSON body. Raises RouterError, ClientDisconnected."""
    ids = bool(body.return_token_ids)

    async def respond(watch: DisconnectWatch) -> Response:
        if body.stream:
            stream = await watch.until(service.stream_complete(body, request_id))
            return _event_stream(stream, _token_times(headers, CompletionChunks(stream, ids)), watch)
        result = await watch.until(service.complete(body, request_id))
        return FastJSONResponse(completion_body(result, ids), headers=_path_headers(result.head))

    return await _watched(receive, respond)


async def chat_completion(service: RouterService, body: ChatCompletionRequest, request_id: str, receive: Receive,
                          headers: Mapping[str, str]) -> Response:
    """POST /v1/chat/completions (see completion)."""
    ids = bool(body.return_token_ids)

    async def respond(watch: DisconnectWatch) -> Response:
        if body.stream:
            stream = await watch.until(service.stream_chat(body, request_id))
            return _event_stream(stream, _token_times(headers, ChatChunks(stream, ids)), watch)
        result = await watch.until(service.chat(body, request_id))
        return FastJSONResponse(chat_body(result, ids), headers=_path_headers(result.head))

    return await _watched(receive, respond)


async def _watched(receive: Receive, respond: Callable[[DisconnectWatch], Awaitable[Response]]) -> Response:
    """`respond` under the request's disconnect watch. An event stream takes the watch over (it
    watches the writing too, then closes it); any other answer, or an error, closes it here."""
    watch = DisconnectWatch(receive)
    try:
        response = await respond(watch)
    except BaseException:
        watch.close()
        raise
    if not isinstance(response, EventStreamResponse):
        watch.close()
    return response


Handler = Callable[[RouterService, object, str, Receive, Mapping[str, str]], Awaitable[Response]]
ROUTES: dict[str, tuple[type, Handler]] = {
    "/v1/completions": (CompletionRequest, completion),
    "/v1/chat/completions": (ChatCompletionRequest, chat_completion),
}


class FastJSONResponse(JSONResponse):
    """A whole completion's JSON encoded with orjson (router.api.openai_encode.dumps)."""

    def render(self, content: object) -> bytes:
        return dumps(content)


def _token_times(headers: Mapping[str, str], chunks: ChunkEncoder) -> ChunkEncoder:
    """The client asked for each token's sample time (X-Pdserve-Token-Times: 1)."""
    return WithTokenTimes(chunks) if headers.get(TOKEN_TIMES_HEADER) == "1" else chunks


def _path_headers(head: ResponseHead) -> dict[str, str]:
    headers = {} if head.path is None else {PATH_HEADER: head.path}
    if head.route is not None:
        headers[ROUTE_HEADER] = head.route
    return headers


def _event_stream(stream: ResponseStream, chunks: ChunkEncoder, watch: DisconnectWatch) -> EventStreamResponse:
    """The stream's SSE response, which takes over the request's disconnect watch."""
    return EventStreamResponse(sse_lines(stream, chunks), stream.aclose, headers=_path_headers(stream.head),
                               watch=watch)


# ------------------------------------------------------------------ the fast path
class GenerationFastPath:
    """An ASGI middleware (the innermost guard) answering well-formed generation requests
    itself; see the module docstring. `app`: the FastAPI app's inner stack, for the rest."""

    def __init__(self, app: ASGIApp, service: RouterService) -> None:
        self.app = app
        self._service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not is_json(headers.get("content-type")):
            await self.app(scope, receive, send)  # FastAPI's route refuses it (400, vLLM's message)
            return
        body, receive = await _whole_body(receive)
        if body is None:
            return  # the client left before sending its body: nobody to answer
        model, handler = route
        try:
            data = orjson.loads(body)
            request = model.model_validate(data) if isinstance(data, dict) else None
        except (orjson.JSONDecodeError, ValidationError):
            request = None
        if request is None:  # FastAPI gives the refusal its shape (json.loads accepts a little more)
            await self.app(scope, replay_body(body, receive), send)
            return
        try:
            response = await handler(self._service, request, scope["state"]["request_id"], receive, headers)
        except RouterError as exc:
            response = error_response(exc)
        except ClientDisconnected:
            response = Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # a bug: FastAPI's error handler's answer, then the server logs it
            await error_response(internal_error(exc))(scope, receive, send)
            raise
        await response(scope, receive, send)


async def _whole_body(receive: Receive) -> tuple[bytes | None, Receive]:
    """The request body (None when the client left first) and the receive to go on with. The
    body guard has bounded it already and hands it over in one message."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, receive
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), receive
