"""benchmarks/router_overhead.py runs end to end in a tiny mode: pdserve (one process,
--router-workers 2, and --worker-link false: its calls to the workers over gRPC) and the Rust routers (when installed: the `bench-peers` extra) each serve
every request through their instant doubles, in two rounds, and the report names the goals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.router_peers import RUST_ROUTERS, rust_router_command

pytestmark = pytest.mark.timeout(400)
REPO = Path(__file__).resolve().parents[2]


def test_the_router_overhead_benchmark_measures_every_router_in_a_tiny_run():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "router_overhead.py"), "--concurrency", "1,2",
         "--requests", "6", "--requests-per-flight", "4", "--warmup", "2", "--rounds", "2", "--no-results"],
        cwd=REPO, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()
            if line.split() and line.split()[0] in ("pdserve", "pdserve-x2", "pdserve-grpc", *RUST_ROUTERS)
            and len(line.split()) == 15 and line.split()[1].isdigit()]
    measured = {row[0] for row in rows}
    installed = {name for name in RUST_ROUTERS if rust_router_command(name) is not None}
    assert measured == {"pdserve", "pdserve-x2", "pdserve-grpc", *installed}, run.stdout
    assert sorted((row[0], row[1]) for row in rows) == sorted(
        (name, c) for name in measured for c in ("1", "2"))
    assert {row[-1] for row in rows} == {"0/0"}, run.stdout  # failed: router/direct
    assert "doubles CPU ms/req" in run.stdout and all(float(row[12]) >= 0 for row in rows), run.stdout
    # (a tiny run is a few clock ticks of CPU: 0.00 is a fair reading there)
    assert "CPU per request at 2 in flight, router + doubles + client" in run.stdout
    for name in set(RUST_ROUTERS) - installed:  # named, with the reason, never silently left out
        assert f"skipping {name}: not installed (pip install 'pdserve[bench-peers]')" in run.stdout
    assert "pdserve added p50 at 1 in flight:" in run.stdout
    # 6 prompts; at 2 in flight 4 per request in flight, the prompts reused in turn
    assert "timed requests per path and concurrency: 6 at 1 in flight, 8 at 2 in flight (6 prompts" in run.stdout
    assert "pdserve (worker link) / pdserve-grpc req/s at 2 in flight:" in run.stdout
    if installed:  # two rounds: each req/s ratio comes with its per-round spread
        assert "req/s at 2 in flight:" in run.stdout and ", per round: " in run.stdout
