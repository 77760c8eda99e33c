"""benchmarks/token_delivery.py runs end to end in a tiny mode: a cluster per setting (the worker
link, --worker-link false, and the link with the cluster in a session of its own), one after the
other, each streaming with token sample times, and the report gives each setting's delivery
figures, the client's loop stalls and the goal line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


def test_the_token_delivery_benchmark_measures_each_setting_in_a_tiny_run():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "token_delivery.py"), "--rounds", "1", "--num-prompts", "4",
         "--input-len", "24", "--output-len", "4", "--concurrency", "2", "--kv-cache-memory", "128MiB", "--max-model-len", "512",
         "--settings", "link,grpc,own-session", "--no-results"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] == ["1"]]
    assert sorted(row[1] for row in rows) == ["grpc", "link", "own-session"], run.stdout
    for row in rows:
        assert row[-1] == "0", run.stdout  # failed
        assert float(row[2]) > 0 and float(row[-2]) >= 1.0, run.stdout  # delivery p99 measured; tokens per chunk
        stalls, _, longest = row[-5:-2]  # client stalls: count / max ms
        assert int(stalls) >= 0 and float(longest) >= 0, run.stdout
    for setting in ("link", "grpc", "own-session"):
        assert f"{setting}: token delivery p99" in run.stdout, run.stdout
    assert "session: the cluster in the client's session" in run.stdout and "kernel autogroup scheduling: " in run.stdout
