"""The dashboard's routes on the real FastAPI app behind the real guards: the shell (page and
static files) is served without the API key and carries no data, no secret and no inline code;
every data route answers 401 without the key; the vendored chart library ships with its
license and version; the package data covers every static file."""

from __future__ import annotations

import glob
import re
import tomllib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from router.api.http import HttpSettings, create_app
from router.ops.access import AdminAccess
from router.ops.dashboard.history import History
from router.ops.dashboard.http import CSP, dashboard_routes
from router.ops.dashboard.state import DashboardSettings, DashboardState
from router.routing.admission import AdmissionQueue, AdmissionSettings
from router.routing.cluster_backend import TransferTotals
from tests.unit.roles_doubles import CLUSTER, NOW, FakeScaler, roles_api
from tests.unit.router_doubles import ScriptedBackend, call, make_service, token_steps

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "router" / "ops" / "dashboard" / "static"
API_KEY, ADMIN_KEY = "api-secret-1", "admin-secret-2"
BEARER = {"authorization": f"Bearer {API_KEY}"}


def app(api_key: str | None = API_KEY, admin_key: str | None = ADMIN_KEY, scaler=None):
    roles = roles_api(scaler or FakeScaler())

    async def read():
        return CLUSTER

    backend = SimpleNamespace(admission=AdmissionQueue(AdmissionSettings()), rejections=Counter(),
                              fallbacks=Counter(), transfers=TransferTotals())
    state = DashboardState(DashboardSettings("c1", "m", 2048, "cache_aware"), roles, read, backend,
                           clock=lambda: NOW)
    history = History(capacity=5)
    history.append(NOW, {"request_rate": 1.5})
    routes = dashboard_routes(state, history, api_key_required=api_key is not None)
    settings = HttpSettings(api_key=api_key, roles=roles, admin_access=AdminAccess(admin_key, api_key, "127.0.0.1"),
                            ops_routes=(routes,))
    return create_app(make_service(ScriptedBackend(token_steps([1]))), settings)


UNAUTHORIZED = {"error": {"message": "Unauthorized", "type": "AuthenticationError", "param": None, "code": 401}}


@pytest.mark.parametrize("path", ["/v1/dashboard/state", "/v1/dashboard/history", "/v1/dashboard/history?since=1"])
def test_data_routes_answer_401_without_the_api_key(path):
    application = app()
    r = call(application, "GET", path)
    assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
    assert call(application, "GET", path, headers={"authorization": f"Bearer {ADMIN_KEY}x"}).status_code == 401


def test_state_and_history_answer_with_the_api_key():
    application = app()
    state = call(application, "GET", "/v1/dashboard/state", headers=BEARER)
    assert state.status_code == 200 and state.headers["cache-control"] == "no-store"
    assert [(r["role"], r["desired"], r["ready"]) for r in state.json()["roles"]] == [("prefill", 1, 1), ("decode", 2, 1)]
    history = call(application, "GET", "/v1/dashboard/history", headers=BEARER)
    assert history.json() == {"interval_s": 1.0, "capacity": 5, "t": [NOW], "series": {"request_rate": [1.5]}}
    assert call(application, "GET", f"/v1/dashboard/history?since={NOW}", headers=BEARER).json()["t"] == []


def test_a_bad_since_is_a_400_in_vllms_shape():
    r = call(app(), "GET", "/v1/dashboard/history?since=yesterday", headers=BEARER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.since"


def test_the_page_is_served_without_a_key_with_a_strict_csp_and_says_a_key_is_needed():
    r = call(app(), "GET", "/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["content-security-policy"] == CSP
    assert "script-src 'self';" in CSP and "unsafe-inline" not in CSP
    assert (r.headers["x-content-type-options"], r.headers["x-frame-options"]) == ("nosniff", "DENY")
    assert '<meta name="pdserve-api-key" content="required">' in r.text
    assert API_KEY not in r.text and ADMIN_KEY not in r.text
    assert call(app(), "GET", "/dashboard/").text == r.text


def test_without_an_api_key_the_page_says_none_is_needed():
    assert '<meta name="pdserve-api-key" content="none">' in call(app(api_key=None), "GET", "/dashboard").text


def test_static_files_are_served_without_a_key_with_their_media_types():
    application = app()
    js = call(application, "GET", "/dashboard/static/js/main.js")
    assert (js.status_code, js.headers["content-type"]) == (200, "text/javascript; charset=utf-8")
    css = call(application, "GET", "/dashboard/static/vendor/uplot/uPlot.min.css")
    assert (css.status_code, css.headers["content-type"]) == (200, "text/css; charset=utf-8")
    assert call(application, "GET", "/dashboard/static/vendor/uplot/LICENSE").text.startswith("The MIT License")


@pytest.mark.parametrize("path", ["/dashboard/static/nope.js", "/dashboard/static/..%2F..%2Fhttp.py",
                                  "/dashboard/static/js%2F..%2F..%2F..%2Fv1%2Fdashboard%2Fstate",
                                  "/dashboard/static/index.html"])
def test_only_the_shipped_static_files_exist(path):
    """A name is looked up in the table read at start, never on disk (an escaped ../ included)."""
    r = call(app(), "GET", path)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["type"] == "NotFoundError"


def test_only_get_of_the_shell_is_open_other_methods_need_the_key():
    assert call(app(), "POST", "/dashboard").status_code == 401
    assert call(app(), "GET", "/dashboardx").status_code == 401


def test_scale_and_drain_still_need_the_admin_key_and_change_nothing_without_it():
    scaler = FakeScaler()
    application = app(scaler=scaler)
    put = call(application, "PUT", "/v1/roles/decode", json={"replicas": 3}, headers=BEARER)
    drain = call(application, "POST", "/v1/workers/decode-0/drain", headers=BEARER)
    assert (put.status_code, drain.status_code) == (401, 401)
    assert scaler.calls == []


def test_the_page_has_no_inline_script_or_style_and_loads_only_its_own_files():
    page = (STATIC / "index.html").read_text()
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page, re.S)
    assert scripts and all('src="/dashboard/static/' in attrs and body == "" for attrs, body in scripts)
    assert "style=" not in page and "<style" not in page
    assert re.findall(r'(?:href|src)="(/[^"]*)"', page) == [
        "/dashboard/static/vendor/uplot/uPlot.min.css", "/dashboard/static/dashboard.css",
        "/dashboard/static/vendor/uplot/uPlot.iife.min.js", "/dashboard/static/js/main.js"]
    for js in (STATIC / "js").glob("*.js"):
        text = js.read_text()
        assert "innerHTML" not in text and "document.cookie" not in text and "localStorage" not in text, js.name


def test_the_vendored_uplot_ships_with_its_license_and_names_its_version():
    vendor = STATIC / "vendor" / "uplot"
    assert (vendor / "LICENSE").read_text().startswith("The MIT License (MIT)")
    version = (vendor / "VERSION").read_text()
    assert version.startswith("uPlot 1.6.32 (MIT")
    assert (vendor / "uPlot.iife.min.js").read_text().startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")


def test_package_data_covers_every_static_file():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["router.ops.dashboard"]
    package = REPO / "router" / "ops" / "dashboard"
    files = {p.relative_to(package).as_posix() for p in (package / "static").rglob("*") if p.is_file()}
    shipped = {f for pattern in patterns for f in glob.glob(pattern, root_dir=package)}  # as setuptools globs
    assert "static/index.html" in files and files - shipped == set()


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/", "/dashboard/static/js/main.js",
                                  "/dashboard/static/vendor/uplot/LICENSE"])
def test_head_of_the_shell_answers_like_get_without_a_body(path):
    application = app()
    get, head = call(application, "GET", path), call(application, "HEAD", path)
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == str(len(get.content)) != "0"
    assert {k: v for k, v in head.headers.items() if k != "x-request-id"} == \
        {k: v for k, v in get.headers.items() if k != "x-request-id"}


def test_head_of_an_unknown_static_file_is_a_404():
    assert call(app(), "HEAD", "/dashboard/static/nope.js").status_code == 404
