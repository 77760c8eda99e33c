"""RouterError -> HTTP (vLLM's JSON shape) and -> gRPC status codes, each in one place."""

from __future__ import annotations

import grpc
import pytest

from router.errors import (
    HttpError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RouterError,
    Unauthorized,
    WorkerFailure,
    http_error,
)
from router.api.grpc_errors import grpc_status, grpc_status_name, grpc_trailing_metadata


def test_invalid_request_maps_to_400_bad_request_error_with_param():
    mapped = http_error(InvalidRequest("top_p must be in (0, 1], got 2.0.", param="top_p"))
    assert mapped == HttpError(400, "top_p must be in (0, 1], got 2.0.", "BadRequestError", "top_p")
    assert mapped.body() == {
        "error": {
            "message": "top_p must be in (0, 1], got 2.0.",
            "type": "BadRequestError",
            "param": "top_p",
            "code": 400,
        }
    }


def test_unknown_model_maps_to_404_with_vllms_message():
    assert http_error(ModelNotFound("gpt-4")).body() == {
        "error": {
            "message": "The model `gpt-4` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_unauthorized_maps_to_401():
    assert http_error(Unauthorized()) == HttpError(401, "Unauthorized", "AuthenticationError", None)


def test_overloaded_maps_to_503_with_retry_after_rounded_up():
    mapped = http_error(Overloaded("no decode worker has 12 free blocks", retry_after_s=1.2))
    assert mapped == HttpError(
        503,
        "no decode worker has 12 free blocks",
        "ServiceUnavailableError",
        None,
        (("Retry-After", "2"),),
    )


def test_worker_failure_maps_to_500_internal_server_error():
    assert http_error(WorkerFailure("decode worker d0 died")) == HttpError(
        500, "decode worker d0 died", "InternalServerError", None
    )


def test_a_bare_router_error_maps_to_500():
    assert http_error(RouterError("unexpected")).status_code == 500
    assert grpc_status_name(RouterError("unexpected")) == "INTERNAL"


def test_negative_retry_after_is_a_bug():
    with pytest.raises(ValueError, match="retry_after_s must be >= 0, got -1"):
        Overloaded("full", retry_after_s=-1)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (ModelNotFound("m"), grpc.StatusCode.NOT_FOUND),
        (Unauthorized(), grpc.StatusCode.UNAUTHENTICATED),
        (Overloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (WorkerFailure("died"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_each_router_error_maps_to_its_grpc_status(error, code):
    assert grpc_status(error) is code


def test_overloaded_carries_retry_after_in_grpc_trailing_metadata():
    assert grpc_trailing_metadata(Overloaded("full", retry_after_s=3)) == (("retry-after", "3"),)
    assert grpc_trailing_metadata(WorkerFailure("died")) == ()
