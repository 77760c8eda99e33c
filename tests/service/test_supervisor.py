"""`pdserve up`'s supervisor with real worker processes (a tiny model), real Redis and the
router's real local scaler: scale up starts a worker, scale down drains the newest, and a
SIGKILLed worker comes back under its id with a new incarnation, counted as a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.loader.locate import default_model_path
from pdserve.cli import build_parser
from pdserve.launchers.local import LocalCluster
from pdserve.ports import free_ports
from pdserve.scalers.local import LocalScaler
from proto.auth import load_cluster_secret
from router.cluster.keys import worker_key
from router.ops.scaling import RoleScale
from router.cluster.redis_settings import PASSWORD_ENV, sync_client
from tests.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(600)

CLUSTER = "suptest"
START_TIMEOUT_S = 240.0


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> Iterator[LocalCluster]:
    """`pdserve up --prefill 0 --decode 1` without its router, on its own embedded Redis (whose
    password only the supervisor and its children know; the router side gets it from the
    environment, as `pdserve up` hands it over)."""
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    model = write_tiny_model(tmp_path / "tiny")
    args = build_parser().parse_args([
        "up", "--cluster", CLUSTER, "--prefill", "0", "--decode", "1", "--drain-timeout", "5",
        "--model", str(model), "--tokenizer", str(default_model_path()), "--dtype", "float32",
        "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--num-threads", "1"])
    local = LocalCluster(args)
    try:
        local.start_state()
        local.start_workers()
        monkeypatch.setenv(PASSWORD_ENV, local.redis.password)  # the router's environment
        yield local
    finally:
        local.stop()


def reconcile_until(cluster: LocalCluster, done: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S):
    """Run the supervisor's loop (as `pdserve up` does) until done(); bounded."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s: {slots(cluster)}"
        cluster.reconcile()
        time.sleep(0.5)


def slots(cluster: LocalCluster) -> list[tuple[str, str]]:
    return [(s.worker_id, s.state) for s in cluster.supervisor.slots]


def registered(cluster: LocalCluster, worker_id: str) -> dict[str, str]:
    """The worker's heartbeat hash in Redis (empty when none)."""
    raw = sync_client(cluster.redis_url).hgetall(worker_key(CLUSTER, worker_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


def scale(cluster: LocalCluster, role: str, replicas: int) -> RoleScale:
    """Through the router's side: the local scaler writes the signed desired count."""
    async def call():
        scaler = LocalScaler(cluster.redis_url, CLUSTER, load_cluster_secret())
        try:
            return await scaler.scale(role, replicas)
        finally:
            await scaler.aclose()

    return asyncio.run(call())


def desired(cluster: LocalCluster) -> dict[str, RoleScale]:
    async def call():
        scaler = LocalScaler(cluster.redis_url, CLUSTER, load_cluster_secret())
        try:
            return await scaler.desired()
        finally:
            await scaler.aclose()

    return asyncio.run(call())


def test_scale_up_down_and_a_killed_worker_restarted(cluster):
    assert slots(cluster) == [("decode-0", "ready")]
    reconcile_until(cluster, lambda: registered(cluster, "decode-0").get("state") == "serving", "decode-0 registers")

    assert scale(cluster, "decode", 2) == RoleScale("decode", 2, 0)
    reconcile_until(cluster, lambda: slots(cluster) == [("decode-0", "ready"), ("decode-1", "ready")],
                    "scale up to 2")
    reconcile_until(cluster, lambda: registered(cluster, "decode-1").get("state") == "serving", "decode-1 registers")
    assert desired(cluster)["decode"] == RoleScale("decode", 2, 0)

    newest = cluster.supervisor.slots[1].process
    scale(cluster, "decode", 1)
    cluster.reconcile()
    assert slots(cluster) == [("decode-0", "ready"), ("decode-1", "draining")]
    reconcile_until(cluster, lambda: slots(cluster) == [("decode-0", "ready")], "decode-1 drains and exits", 60)
    assert newest.poll() == 0  # drained, then exited by itself
    with pytest.raises(ProcessLookupError):
        os.kill(newest.pid, 0)

    first = cluster.supervisor.slots[0].process
    incarnation = registered(cluster, "decode-0")["incarnation"]
    os.kill(first.pid, signal.SIGKILL)
    reconcile_until(cluster, lambda: cluster.supervisor.slots[0].process is not first
                    and slots(cluster) == [("decode-0", "ready")], "decode-0 restarts")
    reconcile_until(cluster, lambda: registered(cluster, "decode-0").get("incarnation", incarnation) != incarnation,
                    "the new incarnation registers")
    assert cluster.supervisor.restarts == {"prefill": 0, "decode": 1}
    assert desired(cluster) == {"prefill": RoleScale("prefill", 0, 0), "decode": RoleScale("decode", 1, 1)}


def start_up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """`pdserve up` as a user runs it (tiny model, its own embedded Redis), until it is up."""
    model = write_tiny_model(tmp_path / "tiny")
    log = tmp_path / "up.log"
    http_port, grpc_port = free_ports(2)
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(http_port), "--grpc-port", str(grpc_port),
           "--cluster", "ctrlc", "--model", str(model), "--tokenizer", str(default_model_path()),
           "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--num-threads", "1",
           *flags]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "pdserve is up" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"pdserve up did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return process, log


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_drains_everything_and_a_second_stops_at_once_without_a_traceback(tmp_path, signals):
    process, log = start_up(tmp_path, "--prefill", "1", "--decode", "1", "--drain-timeout", "30")
    kids = children(process.pid)
    try:
        assert len(kids) == 4  # Redis, decode-0, prefill-0, router
        for _ in range(signals):
            process.send_signal(signal.SIGINT)
            time.sleep(0.2)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "Traceback" not in text
    assert "pdserve up: stopping (draining; Ctrl-C again to stop at once)" in text
    if signals == 1:
        assert "worker decode-0 drained and exited with code 0" in text
        assert "worker prefill-0 drained and exited with code 0" in text
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in kids if alive(pid)] == []
