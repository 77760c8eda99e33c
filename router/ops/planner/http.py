"""GET /v1/plan (thin: ask the Planner, encode). Under the API key like every /v1 route (the
app's ApiKeyMiddleware); errors are RouterErrors answered by the app's one handler."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse

from router.ops.planner.service import Planner


def plan_routes(planner: Planner) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/plan")
    async def get_plan() -> JSONResponse:
        return JSONResponse(planner.to_json(await planner.plan()))

    return api
