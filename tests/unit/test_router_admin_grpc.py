"""pdserve.v1.Admin on the router's real gRPC server: the same roles, guard and errors as HTTP."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc
from router.api.grpc_api import start_grpc_server
from router.ops.access import AdminAccess
from router.ops.scaling import ScalerUnavailable
from tests.unit.roles_doubles import FakeScaler, RecordingDrain, roles_api
from tests.unit.router_doubles import ScriptedBackend, make_service, token_steps

ADMIN, API = "admin-s3cret", "api-s3cret"


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def serve(check, *, host="127.0.0.1", admin_key=ADMIN, api_key=API, scaler=None, drain=None):
    """Run `check(stub, channel)` against a real server; `host` is the bind host the guard sees
    (the server itself listens on 127.0.0.1 so the test needs no external address)."""
    roles = roles_api(scaler, drain)
    access = AdminAccess(admin_key, api_key, host)

    async def go():
        door = await start_grpc_server(make_service(ScriptedBackend(token_steps([1]))), "127.0.0.1", 0,
                                       api_key=api_key, roles=roles, admin_access=access)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{door.port}") as channel:
                return await check(admin_pb2_grpc.AdminStub(channel), channel)
        finally:
            await door.stop(grace=0)

    return asyncio.run(go())


async def outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_get_roles_answers_each_role_with_its_workers():
    async def check(stub, _):
        return await stub.GetRoles(admin_pb2.GetRolesRequest(), metadata=auth(API))

    reply = serve(check, scaler=FakeScaler())
    assert reply.scaler == "fake"
    decode = reply.roles[1]
    assert [r.role for r in reply.roles] == ["prefill", "decode"]
    assert (decode.desired, decode.ready, decode.draining, decode.restarts) == (2, 1, 1, 3)
    assert [(w.worker_id, w.state, w.incarnation, w.heartbeat_age_s) for w in decode.workers] == [
        ("decode-0", "serving", "inc-1", 0.25), ("decode-1", "draining", "inc-1", 0.25)]


def test_without_a_scaler_desired_is_unset():
    async def check(stub, _):
        return await stub.GetRoles(admin_pb2.GetRolesRequest(), metadata=auth(API))

    reply = serve(check)
    assert (reply.scaler, [r.HasField("desired") for r in reply.roles]) == ("", [False, False])


def test_scale_role_with_the_admin_key_records_the_count_and_answers_the_status():
    scaler = FakeScaler()

    async def check(stub, _):
        return await stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="prefill", replicas=2), metadata=auth(ADMIN))

    reply = serve(check, scaler=scaler)
    assert (reply.role, reply.desired, reply.ready, reply.draining) == ("prefill", 2, 1, 0)
    assert scaler.calls == [("prefill", 2)]


def test_admin_calls_are_refused_as_over_http():
    scaler, drain = FakeScaler(), RecordingDrain()
    scale = admin_pb2.ScaleRoleRequest(role="decode", replicas=2)

    async def check(stub, _):
        return [(await outcome(stub.ScaleRole(scale, metadata=m)))[0]
                for m in ((), auth("wrong"), auth(API))] + [
            (await outcome(stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id="decode-0"))))[0],
            (await outcome(stub.GetRoles(admin_pb2.GetRolesRequest())))[0],
            (await outcome(stub.GetRoles(admin_pb2.GetRolesRequest(), metadata=auth(ADMIN))))[0]]

    U = grpc.StatusCode.UNAUTHENTICATED
    assert serve(check, host="0.0.0.0", scaler=scaler, drain=drain) == [U, U, U, U, U, grpc.StatusCode.OK]
    assert (scaler.calls, drain.drained) == ([], [])


def test_without_an_admin_key_beyond_loopback_changes_are_permission_denied():
    async def check(stub, _):
        return await outcome(stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="decode", replicas=2)))

    code, details = serve(check, host="0.0.0.0", admin_key=None, api_key=None, scaler=FakeScaler())
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details.startswith("The admin API is disabled: this router listens on '0.0.0.0'")


def test_errors_map_to_status_codes_with_the_reason():
    async def check(stub, _):
        calls = [stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="decode", replicas=-1), metadata=auth(ADMIN)),
                 stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="decode", replicas=17), metadata=auth(ADMIN)),
                 stub.ScaleRole(admin_pb2.ScaleRoleRequest(role="gpu", replicas=1), metadata=auth(ADMIN)),
                 stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id="nobody"), metadata=auth(ADMIN))]
        return [await outcome(c) for c in calls]

    assert serve(check, scaler=FakeScaler(), drain=RecordingDrain()) == [
        (grpc.StatusCode.INVALID_ARGUMENT, "replicas must be >= 0; got -1"),
        (grpc.StatusCode.INVALID_ARGUMENT, "replicas must be <= 16 (--max-replicas); got 17"),
        (grpc.StatusCode.NOT_FOUND, "Unknown role 'gpu'; the roles are: prefill, decode."),
        (grpc.StatusCode.NOT_FOUND, "No live worker has id 'nobody'."),
    ]


def test_no_scaler_is_failed_precondition_and_an_unreachable_one_unavailable():
    request = admin_pb2.ScaleRoleRequest(role="decode", replicas=1)

    async def check(stub, _):
        return (await outcome(stub.ScaleRole(request, metadata=auth(ADMIN))))[0]

    assert serve(check) == grpc.StatusCode.FAILED_PRECONDITION
    assert serve(check, scaler=FakeScaler(fail=ScalerUnavailable("gone"))) == grpc.StatusCode.UNAVAILABLE


def test_drain_worker_calls_the_workers_drain():
    drain = RecordingDrain()

    async def check(stub, _):
        return await stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id="prefill-0"), metadata=auth(ADMIN))

    reply = serve(check, drain=drain)
    assert (reply.started, reply.in_flight, drain.drained) == (True, 2, ["prefill-0"])


def test_admin_is_in_health_and_reflection():
    async def check(_, channel):
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Admin"))
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = [s.name async for reply in stream for s in reply.list_services_response.service]
        return health.status, services

    status, services = serve(check)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "pdserve.v1.Admin" in services and "pdserve.v1.Generation" in services
