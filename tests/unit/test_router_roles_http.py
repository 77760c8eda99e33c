"""GET/PUT /v1/roles and POST /v1/workers/{id}/drain on the real FastAPI app, with a Scaler
that records its calls and fixed snapshots: exact status codes and bodies."""

from __future__ import annotations

import asyncio
import time

import pytest

import router.ops.roles as roles_module
from router.api.http import HttpSettings, create_app
from router.ops.access import AdminAccess
from router.ops.scaling import ScaleError, ScalerUnavailable
from tests.unit.roles_doubles import FakeScaler, RecordingDrain, roles_api
from tests.unit.router_doubles import ScriptedBackend, call, make_service, token_steps

LOOPBACK = "127.0.0.1"


def app(scaler=None, drain=None, host=LOOPBACK, admin_key=None, api_key=None, max_replicas=16):
    roles = roles_api(scaler, drain, max_replicas=max_replicas)
    settings = HttpSettings(api_key=api_key, roles=roles, admin_access=AdminAccess(admin_key, api_key, host))
    return create_app(make_service(ScriptedBackend(token_steps([1]))), settings)


def put(application, role: str, body, **headers):
    content = body if isinstance(body, (str, bytes)) else None
    json_body = None if content is not None else body
    return call(application, "PUT", f"/v1/roles/{role}", json=json_body, content=content,
                headers={"content-type": "application/json", **headers})


def error(message: str, code: int, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


DECODE = {"role": "decode", "desired": 2, "ready": 1, "draining": 1, "restarts": 3, "workers": [
    {"worker_id": "decode-0", "address": "10.0.0.1:5008", "state": "serving", "incarnation": "inc-1",
     "heartbeat_age_s": 0.25},
    {"worker_id": "decode-1", "address": "10.0.0.1:5008", "state": "draining", "incarnation": "inc-1",
     "heartbeat_age_s": 0.25}]}
PREFILL = {"role": "prefill", "desired": 1, "ready": 1, "draining": 0, "restarts": 0, "workers": [
    {"worker_id": "prefill-0", "address": "10.0.0.1:5009", "state": "serving", "incarnation": "inc-7",
     "heartbeat_age_s": 1.5}]}


def test_get_roles_lists_each_role_with_the_scalers_counts_and_every_worker():
    response = call(app(FakeScaler()), "GET", "/v1/roles")
    assert response.status_code == 200
    assert response.json() == {"scaler": "fake", "roles": [PREFILL, DECODE]}
    assert call(app(FakeScaler()), "GET", "/v1/roles/decode").json() == DECODE


def test_without_a_scaler_desired_is_null_and_restarts_zero():
    body = call(app(), "GET", "/v1/roles").json()
    assert body["scaler"] is None
    assert [(r["role"], r["desired"], r["ready"], r["draining"], r["restarts"]) for r in body["roles"]] == [
        ("prefill", None, 1, 0, 0), ("decode", None, 1, 1, 0)]


def test_put_records_the_desired_count_and_answers_200_with_the_roles_status():
    scaler = FakeScaler()
    response = put(app(scaler), "decode", {"replicas": 3})
    assert response.status_code == 200
    assert response.json() == DECODE | {"desired": 3}
    assert scaler.calls == [("decode", 3)]


def test_put_to_zero_is_allowed():
    scaler = FakeScaler()
    assert put(app(scaler), "prefill", {"replicas": 0}).status_code == 200
    assert scaler.calls == [("prefill", 0)]


@pytest.mark.parametrize("replicas, message", [
    (-1, "replicas must be >= 0; got -1"),
    ("2", "replicas must be an integer; got '2'"),
    (2.0, "replicas must be an integer; got 2.0"),
    (1.5, "replicas must be an integer; got 1.5"),
    (True, "replicas must be an integer; got True"),
    (None, "replicas must be an integer; got None"),
    (17, "replicas must be <= 16 (--max-replicas); got 17"),
])
def test_a_bad_replica_count_is_400_with_the_reason_and_never_reaches_the_scaler(replicas, message):
    scaler = FakeScaler()
    response = put(app(scaler), "decode", {"replicas": replicas})
    assert (response.status_code, response.json()) == (400, error(message, 400, "BadRequestError", "replicas"))
    assert scaler.calls == []


def test_max_replicas_is_the_configured_limit():
    response = put(app(FakeScaler(), max_replicas=4), "decode", {"replicas": 5})
    assert response.json()["error"]["message"] == "replicas must be <= 4 (--max-replicas); got 5"
    assert put(app(FakeScaler(), max_replicas=4), "decode", {"replicas": 4}).status_code == 200


@pytest.mark.parametrize("body, message, param", [
    ({}, 'The body must be a JSON object {"replicas": N}.', "replicas"),
    ([3], 'The body must be a JSON object {"replicas": N}.', "replicas"),
    ({"replicas": 2, "role": "decode"}, "Unknown field(s): role; only replicas may be set.", "role"),
    ("{nope", "JSON decode error: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
     None),
])
def test_a_malformed_body_is_400(body, message, param):
    response = put(app(FakeScaler()), "decode", body)
    assert (response.status_code, response.json()) == (400, error(message, 400, "BadRequestError", param))


def test_put_needs_a_json_media_type():
    response = call(app(FakeScaler()), "PUT", "/v1/roles/decode", content=b'{"replicas": 1}',
                    headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Unsupported Media Type: Only 'application/json' is allowed"


def test_an_unknown_role_is_404_for_get_and_put():
    scaler = FakeScaler()
    expected = error("Unknown role 'gpu'; the roles are: prefill, decode.", 404, "NotFoundError", "role")
    assert (put(app(scaler), "gpu", {"replicas": -5}).status_code, put(app(scaler), "gpu", {"replicas": 1}).json()
            ) == (404, expected)
    response = call(app(scaler), "GET", "/v1/roles/gpu")
    assert (response.status_code, response.json()) == (404, expected)
    assert scaler.calls == []


def test_scaling_without_a_scaler_is_409_conflict():
    response = put(app(None), "decode", {"replicas": 2})
    assert response.status_code == 409
    assert response.json() == error(
        "This router has no scaler (--scaler none), so nothing would act on a desired count: the role's "
        "workers are started and stopped outside pdserve. Start the router with --scaler local, ray or "
        "kubernetes (pdserve up and the Helm chart do) to scale from here.", 409, "ConflictError")


def test_the_scalers_refusal_is_400_and_its_absence_503():
    refused = put(app(FakeScaler(fail=ScaleError("decode workers need 2 GiB each; 1 GiB is free"))),
                  "decode", {"replicas": 2})
    assert (refused.status_code, refused.json()) == (400, error(
        "decode workers need 2 GiB each; 1 GiB is free", 400, "BadRequestError", "replicas"))
    down = FakeScaler(fail=ScalerUnavailable("no supervisor status in Redis"))
    for response in (put(app(down), "decode", {"replicas": 2}), call(app(down), "GET", "/v1/roles")):
        assert (response.status_code, response.json()) == (503, error(
            "The scaler 'fake' is unavailable: no supervisor status in Redis", 503, "ServiceUnavailableError"))


def test_drain_calls_the_workers_drain_and_answers_202():
    drain = RecordingDrain()
    response = call(app(drain=drain), "POST", "/v1/workers/decode-0/drain")
    assert (response.status_code, response.json()) == (202, {"worker_id": "decode-0", "started": True,
                                                             "in_flight": 2})
    assert drain.drained == ["decode-0"]


def test_draining_an_unknown_worker_is_404():
    drain = RecordingDrain()
    response = call(app(drain=drain), "POST", "/v1/workers/decode-9/drain")
    assert (response.status_code, response.json()) == (404, error(
        "No live worker has id 'decode-9'.", 404, "NotFoundError", "worker_id"))
    assert drain.drained == []


def test_metrics_show_replicas_per_role_and_state_and_restarts():
    text = call(app(FakeScaler()), "GET", "/metrics").text
    for line in ('pdserve_role_replicas{role="decode",state="desired"} 2.0',
                 'pdserve_role_replicas{role="decode",state="ready"} 1.0',
                 'pdserve_role_replicas{role="decode",state="draining"} 1.0',
                 'pdserve_role_replicas{role="prefill",state="desired"} 1.0',
                 'pdserve_worker_restarts_total{role="decode"} 3.0',
                 'pdserve_worker_restarts_total{role="prefill"} 0.0'):
        assert line in text.splitlines()


def test_metrics_without_a_scaler_have_no_desired_series():
    text = call(app(None), "GET", "/metrics").text
    assert 'pdserve_role_replicas{role="decode",state="ready"} 1.0' in text.splitlines()
    assert 'state="desired"' not in text


class HungScaler(FakeScaler):
    async def scale(self, role, replicas: int):
        self.calls.append((role, replicas))
        await asyncio.sleep(60)


def test_a_scaler_that_does_not_answer_is_503_after_its_bound(monkeypatch):
    monkeypatch.setattr(roles_module, "SCALER_TIMEOUT_S", 0.05)
    started = time.monotonic()
    response = put(app(HungScaler()), "decode", {"replicas": 2})
    assert (response.status_code, response.json()) == (503, error(
        "The scaler 'fake' did not answer within 0.05 s.", 503, "ServiceUnavailableError"))
    assert time.monotonic() - started < 10  # generous: the bound is 0.05 s on a loaded machine


def test_metrics_keep_the_last_view_while_the_scaler_is_unavailable():
    scaler = FakeScaler()
    application = app(scaler)
    call(application, "GET", "/metrics")
    scaler.fail = ScalerUnavailable("gone")
    response = call(application, "GET", "/metrics")
    assert response.status_code == 200
    assert 'pdserve_role_replicas{role="decode",state="desired"} 2.0' in response.text.splitlines()
