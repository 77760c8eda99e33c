"""`pdserve scale`: the command-line client of the router's roles API, against a stub router
(the router side of these routes has its own tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "admin-key-123"


class StubRouter:
    """GET /v1/roles and PUT /v1/roles/{role} over real HTTP; records each call and answers
    the next queued body (or the current roles)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None, object]] = []
        self.roles = {"prefill": {"role": "prefill", "desired": 1, "ready": 1, "draining": 0, "restarts": 0,
                                  "workers": [{"worker_id": "prefill-0", "address": "127.0.0.1:5001",
                                               "state": "serving"}]},
                      "decode": {"role": "decode", "desired": 1, "ready": 1, "draining": 0, "restarts": 2,
                                 "workers": [{"worker_id": "decode-0", "address": "127.0.0.1:5002",
                                              "state": "serving"}]}}
        self.ready_after_gets = 0
        """PUT sets desired; ready follows after this many GETs (a supervisor catching up)."""
        self._pending: dict[str, int] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                stub.calls.append(("GET", self.path, self.headers.get("Authorization"), None))
                stub._tick()
                self._answer(200, {"scaler": "local", "roles": list(stub.roles.values())})

            def do_PUT(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.calls.append(("PUT", self.path, self.headers.get("Authorization"), body))
                if self.headers.get("Authorization") != f"Bearer {ADMIN_KEY}":
                    self._answer(401, {"error": {"message": "invalid admin key", "type": "AuthenticationError",
                                                 "param": None, "code": 401}})
                    return
                role = self.path.rsplit("/", 1)[1]
                stub.roles[role]["desired"] = body["replicas"]
                stub._pending[role] = stub.ready_after_gets
                self._answer(202, stub.roles[role])

            def _answer(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _tick(self) -> None:
        for role, left in list(self._pending.items()):
            if left <= 0:
                self.roles[role]["ready"] = self.roles[role]["desired"]
                del self._pending[role]
            else:
                self._pending[role] = left - 1


@pytest.fixture
def stub(monkeypatch) -> Iterator[StubRouter]:
    for name in ("PDSERVE_ADMIN_KEY", "PDSERVE_ADMIN_KEY_FILE", "PDSERVE_API_KEY", "PDSERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    router = StubRouter()
    thread = threading.Thread(target=router.server.serve_forever, daemon=True)
    thread.start()
    yield router
    router.server.shutdown()
    router.server.server_close()
    thread.join(timeout=5)


def test_scale_puts_each_role_with_the_admin_key_from_the_environment(stub, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", ADMIN_KEY)
    assert main(["scale", "prefill=2", "decode=3", "--url", stub.url]) == 0
    assert stub.calls == [("PUT", "/v1/roles/prefill", f"Bearer {ADMIN_KEY}", {"replicas": 2}),
                          ("PUT", "/v1/roles/decode", f"Bearer {ADMIN_KEY}", {"replicas": 3})]
    assert capsys.readouterr().out == "prefill: desired 2 (ready 1)\ndecode: desired 3 (ready 1)\n"


def test_scale_reads_the_admin_key_from_a_file_flag(stub, tmp_path, capsys):
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    assert main(["scale", "decode=0", "--url", stub.url, "--admin-key-file", str(key_file)]) == 0
    assert stub.calls == [("PUT", "/v1/roles/decode", f"Bearer {ADMIN_KEY}", {"replicas": 0})]


def test_a_refused_scale_prints_the_routers_reason_and_exits_1(stub, capsys):
    assert main(["scale", "decode=2", "--url", stub.url]) == 1
    assert capsys.readouterr().err == "pdserve scale: PUT /v1/roles/decode: 401 invalid admin key\n"


def test_scale_without_assignments_prints_the_roles_as_a_table(stub, capsys):
    assert main(["scale", "--url", stub.url]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "scaler: local",
        "ROLE     DESIRED READY DRAINING RESTARTS",
        "prefill        1     1        0        0",
        "  prefill-0      serving   127.0.0.1:5001",
        "decode         1     1        0        2",
        "  decode-0       serving   127.0.0.1:5002",
    ]
    assert stub.calls == [("GET", "/v1/roles", None, None)]


def test_scale_wait_polls_until_ready_equals_desired(stub, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", ADMIN_KEY)
    stub.ready_after_gets = 2
    assert main(["scale", "decode=2", "--url", stub.url, "--wait", "--timeout", "30"]) == 0
    assert [c[0] for c in stub.calls] == ["PUT", "GET", "GET", "GET"]
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["decode: desired 2 (ready 1)", "scaler: local", "ROLE     DESIRED READY DRAINING RESTARTS"]
    assert out[5] == "decode         2     2        0        2"


def test_scale_wait_gives_up_after_its_timeout_with_exit_1(stub, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", ADMIN_KEY)
    stub.ready_after_gets = 10**6
    assert main(["scale", "decode=2", "--url", stub.url, "--wait", "--timeout", "1"]) == 1
    assert capsys.readouterr().err == "pdserve scale: not settled within 1 s (decode ready 1/2)\n"


def test_an_unreachable_router_is_one_line_and_exit_1(capsys):
    from pdserve.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["scale", "--url", url]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pdserve scale: cannot reach the router at {url}: ")


@pytest.mark.parametrize("assignment, message", [
    ("prefill=x", "'prefill=x': replicas must be a whole number >= 0, got 'x'"),
    ("gpu=2", "'gpu=2': unknown role 'gpu' (roles: prefill, decode)"),
    ("decode", "'decode': expected ROLE=N, e.g. prefill=2"),
    ("decode=-1", "'decode=-1': replicas must be a whole number >= 0, got '-1'"),
])
def test_bad_assignments_are_one_line_and_exit_2(assignment, message):
    result = subprocess.run([sys.executable, "-m", "pdserve", "scale", assignment, "--url", "http://127.0.0.1:9"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, f"pdserve scale: {message}\n")
