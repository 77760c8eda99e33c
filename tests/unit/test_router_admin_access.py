"""Who may scale and drain: the admin key, the loopback rule, and reads under the API key.

The HTTP tests build the real app for bind host "0.0.0.0" (the decision is a pure function of
the bind host, so no external address is needed) and send requests through ASGI."""

from __future__ import annotations

import pytest

from router.api.http import HttpSettings, create_app
from router.ops.access import AdminAccess, admin_route_access, is_loopback_host
from tests.unit.roles_doubles import FakeScaler, RecordingDrain, roles_api
from tests.unit.router_doubles import ScriptedBackend, call, make_service, token_steps

ADMIN, API = "admin-s3cret", "api-s3cret"
JSON = {"content-type": "application/json"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False),
    ("router.internal", False), ("127.0.0.1.example.com", False),
])
def test_loopback_is_decided_by_the_bind_host_alone(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("method, path, access", [
    ("GET", "/v1/roles", "read"), ("GET", "/v1/roles/decode", "read"), ("PUT", "/v1/roles/decode", "admin"),
    ("POST", "/v1/workers/d-0/drain", "admin"), ("GET", "/v1/workers/d-0/drain", "admin"),
    ("GET", "/v1/cluster", None), ("POST", "/v1/completions", None), ("GET", "/v1/rolesx", None),
])
def test_each_route_needs_its_access(method, path, access):
    assert admin_route_access(method, path) == access


def test_the_admin_key_may_not_equal_the_api_key():
    with pytest.raises(ValueError, match="the admin key must differ from the API key"):
        AdminAccess("same", "same", "0.0.0.0")


def app(host: str, admin_key: str | None, api_key: str | None, scaler=None, drain=None):
    roles = roles_api(scaler or FakeScaler(), drain or RecordingDrain())
    settings = HttpSettings(api_key=api_key, roles=roles, admin_access=AdminAccess(admin_key, api_key, host))
    return create_app(make_service(ScriptedBackend(token_steps([1]))), settings)


def scale(application, headers: dict[str, str]):
    return call(application, "PUT", "/v1/roles/decode", json={"replicas": 3}, headers=JSON | headers)


FORBIDDEN = {"error": {
    "message": "The admin API is disabled: this router listens on '0.0.0.0', beyond loopback, and has no admin "
               "key. Set PDSERVE_ADMIN_KEY or PDSERVE_ADMIN_KEY_FILE (or --admin-key) to scale and drain "
               "workers remotely.", "type": "PermissionDeniedError", "param": None, "code": 403}}
UNAUTHORIZED = {"error": {"message": "Unauthorized", "type": "AuthenticationError", "param": None, "code": 401}}


def test_without_an_admin_key_a_non_loopback_router_refuses_changes_with_403():
    scaler, drain = FakeScaler(), RecordingDrain()
    application = app("0.0.0.0", None, None, scaler, drain)
    for response in (scale(application, {}), scale(application, bearer("anything")),
                     call(application, "POST", "/v1/workers/decode-0/drain")):
        assert (response.status_code, response.json()) == (403, FORBIDDEN)
    assert (scaler.calls, drain.drained) == ([], [])


def test_with_an_admin_key_a_missing_or_wrong_key_is_401_and_the_right_one_scales():
    scaler = FakeScaler()
    application = app("0.0.0.0", ADMIN, API, scaler)
    for headers in ({}, bearer("wrong"), bearer(API), {"authorization": ADMIN}):
        response = scale(application, headers)
        assert (response.status_code, response.json()) == (401, UNAUTHORIZED)
    assert scaler.calls == []
    assert scale(application, bearer(ADMIN)).status_code == 200
    assert scaler.calls == [("decode", 3)]


def test_a_loopback_router_without_an_admin_key_lets_local_callers_scale_even_with_an_api_key():
    scaler, drain = FakeScaler(), RecordingDrain()
    application = app("127.0.0.1", None, API, scaler, drain)
    assert scale(application, {}).status_code == 200
    assert call(application, "POST", "/v1/workers/decode-0/drain").status_code == 202
    assert (scaler.calls, drain.drained) == ([("decode", 3)], ["decode-0"])


def test_a_loopback_router_with_an_admin_key_still_requires_it():
    scaler = FakeScaler()
    assert scale(app("127.0.0.1", ADMIN, None, scaler), {}).status_code == 401
    assert scaler.calls == []


def test_reading_roles_needs_the_api_key_or_the_admin_key_when_an_api_key_is_set():
    application = app("0.0.0.0", ADMIN, API)
    codes = [call(application, "GET", "/v1/roles", headers=h).status_code
             for h in ({}, bearer("wrong"), bearer(API), bearer(ADMIN))]
    assert codes == [401, 401, 200, 200]


def test_reading_roles_is_open_without_an_api_key_even_beyond_loopback():
    assert call(app("0.0.0.0", None, None), "GET", "/v1/roles").status_code == 200


def test_the_admin_key_opens_no_other_route():
    application = app("0.0.0.0", ADMIN, API)
    assert call(application, "GET", "/v1/models", headers=bearer(ADMIN)).status_code == 401
    assert call(application, "GET", "/v1/models", headers=bearer(API)).status_code == 200
