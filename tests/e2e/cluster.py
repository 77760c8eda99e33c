"""Starting `pdserve up` as a user would, on free localhost ports, and tearing it down; scaling
its roles through the public API and waiting (bounded) for the workers to follow."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.ports import free_port, free_ports, port_is_free  # noqa: F401 - the e2e tests import them from here

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningCluster:
    process: subprocess.Popen
    log: Path
    http_port: int
    grpc_port: int
    workers: dict[str, tuple[str, str]] = field(default_factory=dict)
    """worker id -> (gRPC address, metrics address)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def worker_pids(self, worker_id: str) -> list[int]:
        """This cluster's processes for a worker (children of its own `pdserve up`); the id
        must end the argument (decode-1 is not decode-10), wherever it stands in the argv."""
        pattern = f"--worker-id {re.escape(worker_id)}( |$)"
        out = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", "--", pattern],
                             capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def worker_pid(self, worker_id: str) -> int:
        pids = self.worker_pids(worker_id)
        assert len(pids) == 1, f"expected one process for {worker_id}, found {pids}"
        return pids[0]

    def wait_for_exit(self, worker_ids, timeout_s: float = 30) -> dict[str, list[int]]:
        """Until none of these workers has a process (a drained worker deletes its heartbeat
        first, then stops its server and exits); bounded, returns what is left either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = {w: self.worker_pids(w) for w in worker_ids}
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def metrics(self, worker_id: str | None = None) -> str:
        url = f"{self.base_url}/metrics" if worker_id is None else f"http://{self.workers[worker_id][1]}/metrics"
        return httpx.get(url, timeout=10).text

    def refresh_workers(self) -> dict[str, tuple[str, str]]:
        """Re-read the log for workers the supervisor started since (they print the same
        line); a restarted worker's newest line wins."""
        for wid, grpc_addr, metrics_addr in re.findall(WORKER_LINE, self.log.read_text()):
            self.workers[wid] = (grpc_addr, metrics_addr)
        return self.workers

    def roles(self) -> dict[str, dict]:
        """GET /v1/roles, keyed by role (each: desired, ready, draining, restarts, workers)."""
        r = httpx.get(f"{self.base_url}/v1/roles", timeout=10)
        assert r.status_code == 200, r.text
        return {entry["role"]: entry for entry in r.json()["roles"]}

    def put_replicas(self, role: str, replicas: object) -> httpx.Response:
        """PUT /v1/roles/{role} {"replicas": replicas} (any JSON value, to test validation)."""
        return httpx.put(f"{self.base_url}/v1/roles/{role}", json={"replicas": replicas}, timeout=30)

    def scale(self, **replicas: int) -> subprocess.CompletedProcess:
        """`pdserve scale prefill=N decode=M --url ...`, the command-line client."""
        cmd = [sys.executable, "-m", "pdserve", "scale", *(f"{r}={n}" for r, n in replicas.items()),
               "--url", self.base_url]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    def wait_for_roles(self, timeout_s: float = 60, **replicas: int) -> dict[str, dict]:
        """Until each named role has desired == ready == its count and nothing draining, with
        that many workers listed (all serving); returns GET /v1/roles then. Bounded."""
        deadline = time.monotonic() + timeout_s
        while True:
            roles = self.roles()
            if all(_settled(roles[role], n) for role, n in replicas.items()):
                self.refresh_workers()
                return roles
            if time.monotonic() > deadline:
                raise AssertionError(f"roles did not reach {replicas} in {timeout_s:.0f} s: {roles}")
            time.sleep(0.5)

    def cluster_workers(self) -> dict[str, dict]:
        """/v1/cluster's workers (live heartbeats), keyed by worker id."""
        view = httpx.get(f"{self.base_url}/v1/cluster", timeout=10).json()
        return {w["worker_id"]: w for w in view["workers"]}

    def kv_pools(self) -> dict[str, tuple[float, float, float]]:
        """Each live worker's own /metrics: (total, free, reserved) KV blocks."""
        pools = {}
        for wid, w in self.cluster_workers().items():
            text = httpx.get(f"http://{w['metrics_address']}/metrics", timeout=10).text
            pools[wid] = tuple(metric_sum(text, f"pdserve_kv_blocks_{k}") for k in ("total", "free", "reserved"))
        return pools

    def wait_for_empty_pools(self, timeout_s: float = 30) -> dict[str, tuple[float, float, float]]:
        """Until every live worker's KV pool is empty (free == total, reserved 0); bounded,
        returns the last reading either way for the caller's exact assertion."""
        deadline = time.monotonic() + timeout_s
        while True:
            pools = self.kv_pools()
            if all(free == total and reserved == 0 for total, free, reserved in pools.values()):
                return pools
            if time.monotonic() > deadline:
                return pools
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


WORKER_LINE = r"\w+ worker (\S+) serving: gRPC (\S+), metrics http://(\S+)/metrics"


def _settled(role: dict, n: int) -> bool:
    serving = [w for w in role["workers"] if w["state"] == "serving"]
    return role["desired"] == role["ready"] == n and role["draining"] == 0 and len(serving) == n


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples over all its label sets (it must be there)."""
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in metrics"
    return sum(values)


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """A metric's samples summed per value of one label, e.g. routing decisions per decode id."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        key = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get(label)
        if key is not None:
            out[key] = out.get(key, 0.0) + float(value)
    return out


def start_cluster(tmp: Path, *flags: str, timeout_s: float = 600) -> RunningCluster:
    http_port, grpc_port = free_ports(2)
    log = tmp / "pdserve-up.log"
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(http_port), "--grpc-port", str(grpc_port),
           *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    cluster = RunningCluster(process, log, http_port, grpc_port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text()
        if "pdserve is up" in text:
            cluster.refresh_workers()
            return cluster
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {process.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    cluster.stop()
    raise RuntimeError(f"pdserve up did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")
