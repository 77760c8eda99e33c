"""Waiting for and stopping a worker process (`python -m pdserve prefill|decode`) in tests."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def wait_ready(process: subprocess.Popen, ready: Path, log: Path, timeout_s: float) -> tuple[int, int]:
    """(gRPC port, metrics port) once the worker writes its ready file (bounded by timeout_s;
    fails with the worker's log if it died or never got ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().endswith("\n"):
            grpc_port, metrics_port = ready.read_text().split()
            return int(grpc_port), int(metrics_port)
        assert process.poll() is None, f"worker exited with {process.returncode}:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"worker not ready in {timeout_s} s:\n{log.read_text()}")


def stop(process: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL if it has not exited within 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
