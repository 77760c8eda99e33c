"""The timeline routes (thin: read the ring, encode):

    GET /v1/requests/{id}/timeline              -> Timeline.to_json(); 404 when unknown
    GET /v1/requests?order=recent|slowest&limit=N -> {"object": "list", "data": [timeline, ...]}
                                                   (newest, or longest end-to-end, first;
                                                   N <= 200, default 20)

`id` is the X-Request-Id the client got. Like every /v1 route they need the API key when one is
set (router.api.http_guards); errors are RouterErrors, answered by the app's one handler in
vLLM's JSON shape.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse

from router.errors import InvalidRequest, NotFound
from router.ops.timeline import TimelineStore

MAX_LIST_LIMIT = 200
DEFAULT_LIST_LIMIT = 20
ORDERS = ("recent", "slowest")


def timeline_routes(store: TimelineStore) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/requests/{request_id}/timeline")
    async def timeline(request_id: str) -> JSONResponse:
        found = store.get(request_id)
        if found is None:
            raise NotFound(f"No timeline for request {request_id!r} (unknown, or older than the "
                           f"last {store.capacity} requests).")
        return JSONResponse(found.to_json())

    @api.get("/v1/requests")
    async def timelines(order: str = "recent", limit: str = str(DEFAULT_LIST_LIMIT)) -> JSONResponse:
        count = _limit(limit)
        if order not in ORDERS:
            raise InvalidRequest(f"order must be one of {', '.join(ORDERS)}; got {order!r}", param="order")
        found = store.recent(count) if order == "recent" else store.slowest(count)
        return JSONResponse({"object": "list", "data": [t.to_json() for t in found]})

    return api


def _limit(text: str) -> int:
    """1..MAX_LIST_LIMIT; InvalidRequest otherwise (a str here: FastAPI's own 422 is not vLLM's)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIST_LIMIT:
        raise InvalidRequest(f"limit must be an integer 1..{MAX_LIST_LIMIT}; got {text!r}", param="limit")
    return value
