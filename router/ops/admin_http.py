"""The roles and drain routes of the HTTP front door (thin: decode, call RolesApi, encode).

    GET  /v1/roles                  every scalable role's status, and the scaler's name
    GET  /v1/roles/{role}           one role's status
    PUT  /v1/roles/{role}           {"replicas": N} -> 200 and the role's status
    POST /v1/workers/{id}/drain     -> 202 {"worker_id", "started", "in_flight"}

Access (API key for reads, admin key for changes) is decided before a route runs, by
router.api.http_guards.AdminGuardMiddleware. Errors are RouterErrors, answered by the app's one
handler in vLLM's JSON shape.
"""

from __future__ import annotations

import dataclasses
import json

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from router.errors import InvalidRequest
from router.ops.roles import RoleStatus, RolesApi, RolesView, check_role


def role_body(status: RoleStatus) -> dict[str, object]:
    return dataclasses.asdict(status)


def roles_body(view: RolesView) -> dict[str, object]:
    return {"scaler": view.scaler, "roles": [role_body(r) for r in view.roles]}


async def replicas_in(request: Request) -> object:
    """The `replicas` value of a JSON body `{"replicas": N}` (its type is checked later, by
    check_replicas). Raises InvalidRequest for another media type, bad JSON or other keys."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise InvalidRequest("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict) or "replicas" not in body:
        raise InvalidRequest('The body must be a JSON object {"replicas": N}.', param="replicas")
    unknown = sorted(set(body) - {"replicas"})
    if unknown:
        raise InvalidRequest(f"Unknown field(s): {', '.join(unknown)}; only replicas may be set.",
                             param=unknown[0])
    return body["replicas"]


def admin_routes(roles: RolesApi) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/roles")
    async def get_roles() -> JSONResponse:
        return JSONResponse(roles_body(await roles.roles()))

    @api.get("/v1/roles/{role}")
    async def get_role(role: str) -> JSONResponse:
        return JSONResponse(role_body(await roles.role(role)))

    @api.put("/v1/roles/{role}")
    async def put_role(role: str, request: Request) -> JSONResponse:
        check_role(role)  # an unknown role is 404 whatever the body says
        return JSONResponse(role_body(await roles.scale(role, await replicas_in(request))))

    @api.post("/v1/workers/{worker_id}/drain")
    async def drain(worker_id: str) -> JSONResponse:
        outcome = await roles.drain(worker_id)
        return JSONResponse(dataclasses.asdict(outcome), status_code=202)

    return api
