"""The router's one error hierarchy, and its one mapping to HTTP (vLLM's JSON error shape).

Everything the router refuses or fails raises a `RouterError` subclass; `http_error` is the only
place that turns one into a status code and body (`router.api.grpc_errors` is the gRPC twin). The
body is vLLM's current shape: `{"error": {"message", "type", "param", "code"}}` where `code` is
the HTTP status as an integer and `type` names the OpenAI client's exception class.
"""

from __future__ import annotations

import math
from http import HTTPStatus
from dataclasses import dataclass


class RouterError(Exception):
    """Base of every error the router reports to a client; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RouterError):
    """The request can never succeed as sent (bad field, too long for the context)."""


class PayloadTooLarge(InvalidRequest):
    """The request body is larger than --max-request-bytes (refused before it is read whole)."""


class HttpStatusError(RouterError):
    """An HTTP-level refusal from the framework (unknown route 404, wrong method 405, a body
    that is not JSON 400): vLLM answers these with the status phrase as `type`."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


class ModelNotFound(RouterError):
    """The request names a model this router does not serve."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")
        self.model = model


class Unauthorized(RouterError):
    """Missing or wrong API key."""

    def __init__(self, message: str = "Unauthorized") -> None:
        super().__init__(message)


class Forbidden(RouterError):
    """The caller may not use this route at all here (an admin route on a router with no admin
    key that listens beyond loopback); no key would help, so not 401."""


class NotFound(RouterError):
    """The request names a thing this router does not know (a role, a worker id)."""


class Conflict(RouterError):
    """The request is valid but this router's configuration cannot carry it out (scaling
    without a scaler); retrying will not help until the operator changes the configuration."""


class Unavailable(RouterError):
    """Something the request needs is unreachable now (the scaler's controller); retry later."""


class Overloaded(RouterError):
    """No worker can take the request now; the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        if not retry_after_s >= 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_seconds(self) -> int:
        """Whole seconds for a Retry-After value, rounded up so clients never retry too early."""
        return math.ceil(self.retry_after_s)


class WorkerFailure(RouterError):
    """A worker failed (crashed, timed out, broke its protocol) while serving the request."""


def internal_error(exc: Exception) -> WorkerFailure:
    """What a client hears of a bug in the router (the exception itself goes to the log)."""
    return WorkerFailure(f"internal router error ({type(exc).__name__})")


@dataclass(frozen=True)
class HttpError:
    """What an HTTP response for a RouterError carries."""

    status_code: int
    message: str
    type: str
    param: str | None
    headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, dict[str, str | int | None]]:
        """vLLM's JSON error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status_code,
            }
        }


# Most specific class first; `type` strings are vLLM's (and openai-python's exception names).
_HTTP_STATUS: tuple[tuple[type[RouterError], int, str], ...] = (
    # openai-python has no class for 413; vLLM names framework statuses by their phrase.
    (PayloadTooLarge, 413, "Request Entity Too Large"),
    (InvalidRequest, 400, "BadRequestError"),
    (Unauthorized, 401, "AuthenticationError"),
    (ModelNotFound, 404, "NotFoundError"),
    (Forbidden, 403, "PermissionDeniedError"),
    (NotFound, 404, "NotFoundError"),
    (Conflict, 409, "ConflictError"),
    (Unavailable, 503, "ServiceUnavailableError"),
    (Overloaded, 503, "ServiceUnavailableError"),
    (WorkerFailure, 500, "InternalServerError"),
)


def http_error(error: RouterError) -> HttpError:
    """Status code, vLLM-shaped body and headers (Retry-After for Overloaded) for `error`."""
    if isinstance(error, HttpStatusError):
        return HttpError(error.status_code, error.message, _phrase(error.status_code), error.param)
    status, err_type = 500, "InternalServerError"
    for cls, cls_status, cls_type in _HTTP_STATUS:
        if isinstance(error, cls):
            status, err_type = cls_status, cls_type
            break
    headers: tuple[tuple[str, str], ...] = ()
    if isinstance(error, Overloaded):
        headers = (("Retry-After", str(error.retry_after_seconds)),)
    return HttpError(status, error.message, err_type, error.param, headers)


def _phrase(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return "Error"
