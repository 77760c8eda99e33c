"""The public gRPC API's guards, run before any servicer method: the API key and decoding.

The gRPC twin of router.api.http_guards. One server interceptor wraps every method of
pdserve.v1.Generation (another, AdminInterceptor, pdserve.v1.Admin's, with the admin key): without `authorization: Bearer <key>` metadata (when a key is set) the
call ends UNAUTHENTICATED; bytes that do not decode as the request message end it
INVALID_ARGUMENT (grpc's own deserializer would answer INTERNAL/UNKNOWN). Health and
reflection stay open: probes carry no credentials, and reflection only describes the public
schema. Status codes come from router.api.grpc_errors (the one mapping).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from router.api.api_key import ApiKey
from router.ops.access import Access, AdminAccess
from router.errors import InvalidRequest, RouterError, Unauthorized
from router.api.grpc_errors import grpc_status, grpc_trailing_metadata


class Undecodable:
    """What a guarded method receives instead of a request whose bytes did not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


async def abort(context: grpc.aio.ServicerContext, error: RouterError) -> None:
    """End the RPC with the error's status, message and trailing metadata (retry-after)."""
    metadata = grpc_trailing_metadata(error)
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(grpc_status(error), str(error))


class FrontDoorInterceptor(grpc.aio.ServerInterceptor):
    """Guards the methods of one service (`service_name`); other services pass untouched."""

    def __init__(self, service_name: str, api_key: str | None) -> None:
        self._prefix = f"/{service_name}/"
        self._key = ApiKey(api_key) if api_key is not None else None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        refusal = None if self._allowed(details) else Unauthorized()
        return _guarded(handler, refusal)

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        if self._key is None:
            return True
        values = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        return len(values) == 1 and isinstance(values[0], str) and self._key.allows(values[0])


class AdminInterceptor(grpc.aio.ServerInterceptor):
    """Guards pdserve.v1.Admin: each method's access ("read" or "admin", by `methods`) is decided
    by router.ops.access.AdminAccess from the `authorization` metadata, as over HTTP."""

    def __init__(self, service_name: str, methods: dict[str, Access], access: AdminAccess) -> None:
        self._prefix = f"/{service_name}/"
        self._methods = methods
        self._access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        kind = self._methods.get(details.method[len(self._prefix):], "admin")  # unknown: strictest
        values = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        # Two authorization entries are ambiguous: decide as if none was sent.
        authorization = values[0] if len(values) == 1 and isinstance(values[0], str) else None
        return _guarded(handler, self._access.refusal(kind, authorization))


def _tolerant(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse_or_undecodable(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(f"the request message could not be decoded: {exc}")

    return parse_or_undecodable


def _refusal(request: object, refusal: RouterError | None) -> RouterError | None:
    if refusal is not None:
        return refusal
    if isinstance(request, Undecodable):
        return InvalidRequest(request.reason)
    return None


def _guarded(handler: grpc.RpcMethodHandler, refusal: RouterError | None) -> grpc.RpcMethodHandler:
    """`handler` with a tolerant deserializer, refusing before its behaviour runs."""
    parse = _tolerant(handler.request_deserializer)
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request, context):
            error = _refusal(request, refusal)
            if error is not None:
                await abort(context, error)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=parse, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            error = _refusal(request, refusal)
            if error is not None:
                await abort(context, error)
            async for reply in inner_stream(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=parse, response_serializer=handler.response_serializer)
    raise AssertionError(f"the public services have only unary requests, got {handler!r}")
