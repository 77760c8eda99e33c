"""The one mapping from RouterError to gRPC status codes (the HTTP twin is errors.http_error).

grpc is imported only when a mapping is asked for, so importing this module (and the HTTP side
of the router) never loads grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    ModelNotFound,
    Overloaded,
    RouterError,
    Unauthorized,
    Unavailable,
    WorkerFailure,
)

if TYPE_CHECKING:
    import grpc

# Most specific class first; values are grpc.StatusCode member names.
_GRPC_STATUS: tuple[tuple[type[RouterError], str], ...] = (
    (InvalidRequest, "INVALID_ARGUMENT"),
    (ModelNotFound, "NOT_FOUND"),
    (Unauthorized, "UNAUTHENTICATED"),
    (Forbidden, "PERMISSION_DENIED"),
    (NotFound, "NOT_FOUND"),
    # gRPC's own guide: the system is not in the state the operation needs (no scaler).
    (Conflict, "FAILED_PRECONDITION"),
    (Unavailable, "UNAVAILABLE"),
    (Overloaded, "RESOURCE_EXHAUSTED"),
    # A failed worker is transient from the client's side: another attempt may land elsewhere.
    (WorkerFailure, "UNAVAILABLE"),
)


def grpc_status_name(error: RouterError) -> str:
    """The grpc.StatusCode member name for `error` ("INTERNAL" for an unmapped RouterError)."""
    for cls, name in _GRPC_STATUS:
        if isinstance(error, cls):
            return name
    return "INTERNAL"


def grpc_status(error: RouterError) -> grpc.StatusCode:
    """The grpc.StatusCode for `error` (imports grpc)."""
    import grpc

    return getattr(grpc.StatusCode, grpc_status_name(error))


def grpc_trailing_metadata(error: RouterError) -> tuple[tuple[str, str], ...]:
    """Metadata to send with the status: `retry-after` seconds for Overloaded, as in HTTP."""
    if isinstance(error, Overloaded):
        return (("retry-after", str(error.retry_after_seconds)),)
    return ()
