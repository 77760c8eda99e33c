"""`pdserve up --launcher ray --ray-address ADDRESS` on a Ray cluster that was there before
(`ray start --head`, as an operator runs it), and `pdserve down --launcher ray`: the cluster
serves, a second `pdserve up` for the same cluster name is refused, `down` drains and removes
every actor pdserve created, and the Ray cluster is left as it was found (running, all its CPUs
free, no actor of pdserve's namespace)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.cluster import free_ports, start_cluster
from tests.e2e.load import MODEL

pytest.importorskip("ray", reason="the Ray launcher needs pdserve[ray] (the test extras include it)")
pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "token"}
"""`ray start` enables Ray's token authentication; a client that names the cluster's address
(not `auto`) must say so, and finds the token in ~/.ray/auth_token, as any Ray client does."""


def ray_state(address: str) -> dict:
    """What a fresh driver sees of the Ray cluster: its CPUs, free CPUs, pdserve's actors."""
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps({'cpus': ray.cluster_resources().get('CPU'), "
            "'free': ray.available_resources().get('CPU'), "
            "'actors': sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True) "
            "if a['namespace'] == 'pdserve-default')}))" % address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    if subprocess.run(["pgrep", "-f", "gcs_server"], capture_output=True).returncode == 0:
        pytest.skip("another Ray instance runs on this machine")
    gcs_port, dashboard_port = free_ports(2)
    out = subprocess.run([RAY, "start", "--head", f"--port={gcs_port}", "--num-cpus=2", "--disable-usage-stats",
                          f"--dashboard-port={dashboard_port}"], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (address,) = set(re.findall(r"ray start --address='([^']+)'", out.stdout + out.stderr))
    try:
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def test_up_on_an_existing_cluster_serves_refuses_a_twin_and_down_leaves_the_cluster_as_found(
        ray_head, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # start_cluster's `pdserve up` inherits it
    found = ray_state(ray_head)
    assert found == {"cpus": 2.0, "free": 2.0, "actors": []}
    cluster = start_cluster(tmp_path, "--launcher", "ray", "--ray-address", ray_head, "--ray-worker-host", "127.0.0.1",
                            "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5", "--kv-cache-memory", "256MiB",
                            "--max-model-len", "1024")
    try:
        r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers["x-pdserve-path"] == "disaggregated"
        running = ray_state(ray_head)
        assert running["actors"] == ["controller", "decode-0", "prefill-0", "redis", "router"]
        assert running["free"] == 1.0  # 0.5 CPU each for the two workers; router, Redis, controller ask none

        http_port, grpc_port = free_ports(2)
        twin = subprocess.run([sys.executable, "-m", "pdserve", "up", "--launcher", "ray", "--ray-address", ray_head,
                               "--port", str(http_port), "--grpc-port", str(grpc_port)],
                              capture_output=True, text=True, timeout=120, env=ENV)
        assert twin.returncode == 1
        assert ("pdserve up: cluster 'default' is already running on this Ray cluster (namespace pdserve-default); "
                "stop it with `pdserve down --launcher ray`") in twin.stderr

        down = subprocess.run([sys.executable, "-m", "pdserve", "down", "--launcher", "ray", "--ray-address", ray_head],
                              capture_output=True, text=True, timeout=240, env=ENV)
        assert down.returncode == 0, down.stdout + down.stderr
        assert down.stdout.splitlines()[-2:] == [
            "pdserve down: stopping pdserve up --launcher ray (cluster 'default')",
            "pdserve down: stopped; no actor of the cluster is left"]
        assert cluster.process.wait(timeout=60) == 0
    finally:
        cluster.stop()
    log = cluster.log.read_text()
    assert "`pdserve down` asked to stop (draining)" in log
    for worker in ("prefill-0", "decode-0"):
        assert f"worker {worker} drained and exited with code 0" in log
    deadline = time.monotonic() + 30
    while ray_state(ray_head) != found and time.monotonic() < deadline:
        time.sleep(1)
    assert ray_state(ray_head) == found


def test_down_without_a_running_cluster_says_so(ray_head):
    down = subprocess.run([sys.executable, "-m", "pdserve", "down", "--launcher", "ray", "--ray-address", ray_head,
                           "--cluster", "nothing-here"], capture_output=True, text=True, timeout=120, env=ENV)
    assert down.returncode == 1
    assert down.stdout.strip().splitlines()[-1] == "pdserve down: no pdserve cluster 'nothing-here' runs on this Ray cluster"
