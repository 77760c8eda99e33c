"""A real `pdserve router` process serves the roles API over HTTP and gRPC, guarded by the
admin key from its environment, with the role gauges on /metrics (no workers, no Redis: the
roles are empty, which is what an operator sees before scaling up)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]
ADMIN = "process-admin-key"


def start_router(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int, int, Path]:
    ready, log = tmp_path / "ready", tmp_path / "router.log"
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
           "--ready-file", str(ready), "--max-replicas", "4"]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                                   stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().endswith("\n"):
            http_port, grpc_port = ready.read_text().split()
            return process, int(http_port), int(grpc_port), log
        assert process.poll() is None, f"router exited with {process.returncode}:\n{log.read_text()}"
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"router not ready in 120 s:\n{log.read_text()}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


EMPTY_ROLE = {"desired": None, "ready": 0, "draining": 0, "restarts": 0, "workers": []}


def test_a_router_process_serves_roles_guarded_by_its_admin_key(tmp_path):
    process, http_port, grpc_port, log = start_router(tmp_path, {"PDSERVE_ADMIN_KEY": ADMIN})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as client:
            roles = client.get("/v1/roles")
            unauthorized = client.put("/v1/roles/decode", json={"replicas": 2})
            too_many = client.put("/v1/roles/decode", json={"replicas": 5},
                                  headers={"authorization": f"Bearer {ADMIN}"})
            no_scaler = client.put("/v1/roles/decode", json={"replicas": 2},
                                   headers={"authorization": f"Bearer {ADMIN}"})
            metrics = client.get("/metrics").text.splitlines()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            reply = admin_pb2_grpc.AdminStub(channel).GetRoles(admin_pb2.GetRolesRequest(), timeout=30)
    finally:
        stop(process)
    assert (roles.status_code, roles.json()) == (200, {"scaler": None, "roles": [
        {"role": "prefill", **EMPTY_ROLE}, {"role": "decode", **EMPTY_ROLE}]})
    assert unauthorized.status_code == 401
    assert (too_many.status_code, too_many.json()["error"]["message"]) == (
        400, "replicas must be <= 4 (--max-replicas); got 5")
    assert no_scaler.status_code == 409
    assert 'pdserve_role_replicas{role="decode",state="ready"} 0.0' in metrics
    assert [(r.role, r.ready) for r in reply.roles] == [("prefill", 0), ("decode", 0)]
    assert ADMIN not in log.read_text()  # the key is never logged
