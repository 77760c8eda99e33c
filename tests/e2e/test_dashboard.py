"""Issue 14's dashboard acceptance: `pdserve up --prefill 1 --decode 1` with the real model and
an API key and an admin key (from files named in the environment, never argv), streaming
traffic in a background thread, and Debian's chromium driven by Playwright.

One cluster and one browser page for the module; the tests run in order: the data and scale
routes refuse callers without keys -> the page (keys typed into its form) shows 1 + 1 ready
workers with KV bars and live charts -> "+" on decode brings a second ready worker with its own
bar within 60 s -> a request's waterfall (when the router records timelines) -> a screenshot
-> "Drain" removes a worker and "−" scales back, with no failed request -> the console showed
no error all along.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import ROOT, RunningCluster, start_cluster
from tests.e2e.load import fresh_prompts, stream_completion

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
API_KEY, ADMIN_KEY = "dashboard-e2e-api-key", "dashboard-e2e-admin-key"
STREAM_TOKENS = 24
"""Output tokens per background stream: short, so a drain finishes its in-flight work quickly."""
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if shutil.which(CHROMIUM) is None:
    pytest.skip(f"Debian's chromium is not installed at {CHROMIUM}", allow_module_level=True)


@dataclass
class Traffic:
    """Streams one request after another until stopped; counts what did not end well."""

    base_url: str
    done: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        asyncio.run(self._streams())

    async def _streams(self) -> None:
        prompts = fresh_prompts()
        headers = {"authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120, headers=headers) as client:
            i = 0
            while not self.stop.is_set():
                result = await stream_completion(client, prompts[i % len(prompts)], STREAM_TOKENS)
                i += 1
                if result.status != 200 or result.error is not None or not result.done:
                    self.failures.append(f"{result.status} {result.error}")
                else:
                    self.done += 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    for name, key in (("api", API_KEY), ("admin", ADMIN_KEY)):
        (tmp / f"{name}.key").write_text(key)
        (tmp / f"{name}.key").chmod(0o600)
    saved = {k: os.environ.get(k) for k in ("PDSERVE_API_KEY_FILE", "PDSERVE_ADMIN_KEY_FILE")}
    os.environ["PDSERVE_API_KEY_FILE"] = str(tmp / "api.key")
    os.environ["PDSERVE_ADMIN_KEY_FILE"] = str(tmp / "admin.key")
    try:
        c = start_cluster(tmp, "--prefill", "1", "--decode", "1", "--dtype", "float32", "--max-model-len", "1024",
                          "--kv-cache-memory", "192MiB", "--max-replicas", "3")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def traffic(cluster):
    t = Traffic(cluster.base_url)
    thread = threading.Thread(target=t.run, name="dashboard-traffic", daemon=True)
    thread.start()
    yield t
    t.stop.set()
    thread.join(timeout=120)


@dataclass
class Browser:
    page: object
    messages: list[tuple[str, str, str]]
    """(type, text, url) of every console message and page error."""


@pytest.fixture(scope="module")
def browser(cluster, traffic):
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = chromium.new_page(viewport={"width": 1400, "height": 1000})
        messages: list[tuple[str, str, str]] = []
        page.on("console", lambda m: messages.append((m.type, m.text, m.location.get("url", ""))))
        page.on("pageerror", lambda e: messages.append(("pageerror", str(e), "")))
        page.set_default_timeout(30_000)
        try:
            yield Browser(page, messages)
        finally:
            chromium.close()


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_KEY}"}


def roles(cluster: RunningCluster) -> dict[str, dict]:
    r = httpx.get(f"{cluster.base_url}/v1/roles", headers=admin_headers(), timeout=10)
    assert r.status_code == 200, r.text
    return {entry["role"]: entry for entry in r.json()["roles"]}


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


def role_counts(page, role: str) -> tuple[str, str, str]:
    card = page.locator(f"#role-{role}")
    return tuple(card.locator(f".counts .{name}").inner_text() for name in ("desired", "ready", "draining"))


def decode_rows(page) -> list[dict]:
    return page.eval_on_selector_all("#role-decode tr.worker", """rows => rows.map(r => ({
        id: r.dataset.workerId, incarnation: r.dataset.incarnation, state: r.querySelector('.state').textContent,
        segments: r.querySelectorAll('.kvbar .seg').length}))""")


def route_exists(cluster: RunningCluster, path: str) -> bool:
    r = httpx.get(f"{cluster.base_url}{path}", headers={"authorization": f"Bearer {API_KEY}"}, timeout=10)
    return r.status_code != 404


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("path", ["/v1/dashboard/state", "/v1/dashboard/history", "/v1/roles"])
def test_data_endpoints_answer_401_without_the_api_key_while_the_page_shell_is_open(cluster, path):
    assert httpx.get(f"{cluster.base_url}{path}", timeout=10).status_code == 401
    wrong = httpx.get(f"{cluster.base_url}{path}", headers={"authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    page = httpx.get(f"{cluster.base_url}/dashboard", timeout=10)
    assert page.status_code == 200 and API_KEY not in page.text and ADMIN_KEY not in page.text


def test_scale_and_drain_without_the_admin_key_answer_401_and_change_nothing(cluster):
    before = roles(cluster)
    api = {"authorization": f"Bearer {API_KEY}"}
    for headers in ({}, api):
        put = httpx.put(f"{cluster.base_url}/v1/roles/decode", json={"replicas": 2}, headers=headers, timeout=10)
        drain = httpx.post(f"{cluster.base_url}/v1/workers/decode-0/drain", headers=headers, timeout=10)
        assert (put.status_code, drain.status_code) == (401, 401), (put.text, drain.text)
    after = roles(cluster)
    assert [(r["desired"], [w["incarnation"] for w in r["workers"]]) for r in after.values()] == \
        [(r["desired"], [w["incarnation"] for w in r["workers"]]) for r in before.values()]


def test_the_page_shows_one_ready_worker_per_role_with_kv_bars_and_live_charts(cluster, browser):
    page = browser.page
    page.goto(f"{cluster.base_url}/dashboard")
    assert "needs its API key" in page.locator("#notice").inner_text()
    page.fill("#api-key", API_KEY)
    page.fill("#admin-key", ADMIN_KEY)
    page.click("#use-keys")
    page.wait_for_selector("#role-decode tr.worker")
    assert role_counts(page, "prefill") == ("1", "1", "0")
    assert role_counts(page, "decode") == ("1", "1", "0")
    for role in ("prefill", "decode"):
        bars = page.locator(f"#role-{role} tr.worker .kvbar")
        assert bars.count() == 1 and bars.locator(".seg").count() == 4
    assert "blocks x 16 tokens = " in page.locator("#capacity").inner_text()

    def charts_live():
        points = dict(page.eval_on_selector_all(".chart", "els => els.map(e => [e.id, Number(e.dataset.points)])"))
        live = ("chart-request-rate", "chart-ttft", "chart-e2e", "chart-tokens", "chart-kv")
        return points if all(points.get(c, 0) > 0 for c in live) else None

    points = wait_until(charts_live, 60, "non-empty request, latency, token and KV charts")
    assert page.locator(".chart canvas").count() >= 5, points


def test_plus_on_decode_brings_a_second_ready_worker_with_its_own_bar_within_60_s(cluster, browser):
    page = browser.page
    clicked = time.monotonic()
    page.locator("#role-decode .scale-plus").click()
    wait_until(lambda: role_counts(page, "decode")[0] == "2", 10, "desired 2 shown", 0.2)
    pending = page.locator("#role-decode .pending")
    wait_until(lambda: pending.inner_text() == "pending: 1 starting", 10, "the pending change shown", 0.2)

    def two_serving():
        rows = decode_rows(page)
        return rows if [r["state"] for r in rows] == ["serving", "serving"] else None

    rows = wait_until(two_serving, 60, "two serving decode workers on the page", 0.25)
    took = time.monotonic() - clicked
    assert took < 60
    assert [(r["id"], r["segments"]) for r in rows] == [("decode-0", 4), ("decode-1", 4)]
    wait_until(lambda: role_counts(page, "decode") == ("2", "2", "0"), 10, "decode 2 / 2 / 0")
    assert page.locator("#role-decode .pending").is_hidden()
    print(f"\n'+' on decode -> 2 ready on the page in {took:.1f} s (load {os.getloadavg()[0]:.2f})")


def test_clicking_a_request_shows_its_waterfall(cluster, browser):
    if not route_exists(cluster, "/v1/requests"):
        pytest.skip("this router records no request timelines yet (GET /v1/requests is 404)")
    page = browser.page
    page.wait_for_selector("#request-list tr.request")
    row = page.locator("#request-list tr.request").first
    request_id = row.get_attribute("data-request-id")
    row.click()
    page.wait_for_selector("#waterfall .phase")
    shown = page.eval_on_selector_all("#waterfall .phase", "els => els.map(e => e.dataset.phase)")
    timeline = httpx.get(f"{cluster.base_url}/v1/requests/{request_id}/timeline",
                         headers={"authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert shown == [p["name"] for p in timeline["phases"]] and shown
    assert request_id in page.locator("#waterfall h3").inner_text()
    page.locator('#requests-panel .tab[data-order="slowest"]').click()

    def slowest_first():
        cells = page.eval_on_selector_all("#request-list tr.request td:nth-child(2)", "els => els.map(e => e.textContent)")
        e2e = [float(c.replace(",", "").removesuffix(" ms")) for c in cells]
        return e2e if e2e and e2e == sorted(e2e, reverse=True) else None

    wait_until(slowest_first, 10, "the slowest requests listed first")


def test_screenshot_of_the_page(cluster, browser, tmp_path):
    page = browser.page
    page.wait_for_timeout(1500)  # one more refresh of every panel
    target = SCREENSHOT if os.environ.get("PDSERVE_WRITE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target), full_page=True)
    assert target.stat().st_size > 20_000


def test_drain_removes_a_worker_and_minus_scales_back_with_no_failed_request(cluster, browser, traffic):
    page = browser.page
    done_before = traffic.done
    victim = next(r for r in decode_rows(page) if r["id"] == "decode-1")
    button = page.locator('#role-decode tr.worker[data-worker-id="decode-1"] .drain')
    button.click()
    assert button.inner_text() == "Confirm drain"
    button.click()

    def victim_gone():
        live = [w["incarnation"] for w in roles(cluster)["decode"]["workers"]]
        shown = [r["incarnation"] for r in decode_rows(page)]
        return victim["incarnation"] not in live and victim["incarnation"] not in shown

    wait_until(victim_gone, 60, "the drained decode worker gone from the cluster and the page")
    page.locator("#role-decode .scale-minus").click()
    wait_until(lambda: role_counts(page, "decode") == ("1", "1", "0") and len(decode_rows(page)) == 1, 90,
               "decode back to 1 ready, nothing draining")
    wait_until(lambda: traffic.done > done_before + 2, 60, "traffic still flowing")
    assert traffic.failures == []


def test_the_browser_console_shows_no_error(cluster, browser):
    # Routes of features this router may lack answer 404 once per page load (the page then says
    # "not enabled"); only those, and only when the route really is absent, are not errors.
    absent = {path for path in ("/v1/plan", "/v1/requests") if not route_exists(cluster, path)}
    errors = [m for m in browser.messages if m[0] in ("error", "pageerror")
              and not (m[1].startswith("Failed to load resource: the server responded with a status of 404")
                       and httpx.URL(m[2]).path in absent)]
    assert errors == []
    assert [m for m in browser.messages if m[0] == "warning"] == []
