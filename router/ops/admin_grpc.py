"""The public pdserve.v1.Admin service over the same RolesApi as the HTTP roles routes.

Thin: decode, call one RolesApi method, encode. Access (API key for GetRoles, admin key for
ScaleRole and DrainWorker) is decided before a method runs by router.api.grpc_guards.AdminInterceptor;
RouterErrors end the call through router.api.grpc_errors (the one mapping).
"""

from __future__ import annotations

import grpc

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc
from router.errors import RouterError
from router.api.grpc_guards import abort
from router.ops.roles import RoleStatus, RolesApi

ADMIN_SERVICE_NAME = "pdserve.v1.Admin"
ADMIN_METHODS = {"GetRoles": "read", "ScaleRole": "admin", "DrainWorker": "admin"}
"""Each method's access check (router.ops.access)."""


def role_message(status: RoleStatus) -> admin_pb2.RoleStatus:
    message = admin_pb2.RoleStatus(
        role=status.role, ready=status.ready, draining=status.draining, restarts=status.restarts,
        workers=[admin_pb2.WorkerEntry(worker_id=w.worker_id, address=w.address, state=w.state,
                                       incarnation=w.incarnation, heartbeat_age_s=w.heartbeat_age_s)
                 for w in status.workers])
    if status.desired is not None:
        message.desired = status.desired
    return message


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, roles: RolesApi) -> None:
        self.roles = roles

    async def GetRoles(self, request, context: grpc.aio.ServicerContext):
        try:
            view = await self.roles.roles()
        except RouterError as exc:
            await abort(context, exc)
        return admin_pb2.GetRolesResponse(roles=[role_message(r) for r in view.roles], scaler=view.scaler or "")

    async def ScaleRole(self, request, context: grpc.aio.ServicerContext):
        try:
            status = await self.roles.scale(request.role, request.replicas)
        except RouterError as exc:
            await abort(context, exc)
        return role_message(status)

    async def DrainWorker(self, request, context: grpc.aio.ServicerContext):
        try:
            outcome = await self.roles.drain(request.worker_id)
        except RouterError as exc:
            await abort(context, exc)
        return admin_pb2.DrainWorkerResponse(started=outcome.started, in_flight=outcome.in_flight)
