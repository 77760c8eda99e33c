"""Starting `pdserve up` as a user would, on free localhost ports, and tearing it down."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Nothing listens there (TIME_WAIT leftovers of closed connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
        """This cluster's processes for a worker (children of its own `pdserve up`)."""
        out = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", "--", f"--worker-id {worker_id} "],
                             capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def worker_pid(self, worker_id: str) -> int:
        pids = self.worker_pids(worker_id)
        assert len(pids) == 1, f"expected one process for {worker_id}, found {pids}"
        return pids[0]

    def metrics(self, worker_id: str | None = None) -> str:
        url = f"{self.base_url}/metrics" if worker_id is None else f"http://{self.workers[worker_id][1]}/metrics"
        return httpx.get(url, timeout=10).text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_cluster(tmp: Path, *flags: str, timeout_s: float = 600) -> RunningCluster:
    http_port, grpc_port = free_port(), free_port()
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
            for wid, grpc_addr, metrics_addr in re.findall(
                    r"pdserve \w+ worker (\S+): gRPC (\S+), metrics http://(\S+)/metrics", text):
                cluster.workers[wid] = (grpc_addr, metrics_addr)
            return cluster
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {process.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    cluster.stop()
    raise RuntimeError(f"pdserve up did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")
