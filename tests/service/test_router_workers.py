"""`pdserve router --router-workers 2`: two real router processes share the HTTP port (and the
gRPC port), both route real completions to workers found in a real Redis (the instant gRPC
doubles of benchmarks/instant_workers.py), process 1 runs in its own process group but process
0's session, and stopping process 0 stops both — also when it is killed outright."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.loader.locate import DEFAULT_MODEL_NAME
from pdserve.redis_server import EmbeddedRedis, share_cluster_secrets
from pdserve.router_workers import WORKER_HEADER

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]
CLUSTER = "router-workers"


def _wait_file(path: Path, process: subprocess.Popen, log: Path, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        assert process.poll() is None, f"exited with {process.returncode}:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout_s} s:\n{log.read_text()}")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True  # exited; its parent has not reaped it yet
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Embedded Redis + one instant prefill and one instant decode double."""
    tmp = tmp_path_factory.mktemp("router-workers")
    redis = EmbeddedRedis().start()
    share_cluster_secrets(redis)
    log, ready = tmp / "doubles.log", tmp / "doubles.ready"
    with log.open("w") as out:
        doubles = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "instant_workers.py"),
                                    "--redis-url", redis.url, "--cluster", CLUSTER, "--ready-file", str(ready)],
                                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_file(ready, doubles, log)
        yield redis.url, tmp
    finally:
        doubles.send_signal(signal.SIGINT)
        try:
            doubles.wait(timeout=20)
        except subprocess.TimeoutExpired:
            doubles.kill()
            doubles.wait(timeout=10)
        redis.stop()


def start_router(redis_url: str, tmp: Path, name: str) -> tuple[subprocess.Popen, int, int, Path]:
    ready, log = tmp / f"{name}.ready", tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
           "--redis-url", redis_url, "--cluster", CLUSTER, "--ready-file", str(ready), "--router-workers", "2"]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                   stdout=out, stderr=subprocess.STDOUT)
    http_port, grpc_port = _wait_file(ready, process, log).split()
    return process, int(http_port), int(grpc_port), log


def completion(http_port: int) -> httpx.Response:
    """One streamed completion on a new connection (the kernel picks the process per connection)."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hello world", "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        response = client.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body)
    return response


def test_two_router_processes_share_the_port_and_both_route_completions(cluster):
    redis_url, tmp = cluster
    process, http_port, _, log = start_router(redis_url, tmp, "serve")
    try:
        children = _children(process.pid)
        assert len(children) == 1, children
        # Its own process group (a terminal's Ctrl-C reaches process 0 only), process 0's session
        # (under autogroup scheduling the engines' nice then ranks them below it too).
        assert os.getpgid(children[0]) == children[0] != os.getpgid(process.pid)
        assert os.getsid(children[0]) == os.getsid(process.pid)
        deadline, answered = time.monotonic() + 60, {}
        while set(answered) != {"0", "1"} and time.monotonic() < deadline:
            response = completion(http_port)
            if response.status_code == 503:  # that process has not read the doubles from Redis yet
                time.sleep(0.2)
                continue
            assert response.status_code == 200, response.text
            chunks = [json.loads(line[6:]) for line in response.text.split("\n\n")
                      if line.startswith("data: {")]
            answered[response.headers[WORKER_HEADER]] = "".join(c["choices"][0]["text"] for c in chunks)
        assert answered == {"0": " the the the", "1": " the the the"}, log.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, log.read_text()
    assert all(_gone(pid, 5) for pid in children), children


def test_the_other_router_process_exits_when_process_0_is_killed(cluster):
    redis_url, tmp = cluster
    process, _, _, _ = start_router(redis_url, tmp, "killed")
    children = _children(process.pid)
    assert len(children) == 1, children
    argv = Path(f"/proc/{children[0]}/cmdline").read_bytes().decode().split("\0")
    ready = Path(argv[argv.index("--ready-file") + 1])
    assert ready.exists()
    process.kill()
    process.wait(timeout=10)
    assert _gone(children[0], 20), f"router process {children[0]} outlived process 0"
    assert not ready.parent.exists(), list(ready.parent.iterdir())  # nothing left in the temp dir


def test_process_0_restarts_a_router_process_that_dies(cluster):
    redis_url, tmp = cluster
    process, _, _, log = start_router(redis_url, tmp, "restart")
    try:
        [first] = _children(process.pid)
        os.kill(first, signal.SIGKILL)
        deadline, replaced = time.monotonic() + 30, []
        while time.monotonic() < deadline and not replaced:
            replaced = [pid for pid in _children(process.pid) if pid != first]
            time.sleep(0.2)
        assert len(replaced) == 1, log.read_text()
        assert "router process 1 (pid %d) exited with -9; restarting it" % first in log.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    assert _gone(replaced[0], 5)
