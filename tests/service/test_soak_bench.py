"""benchmarks/soak.py runs end to end in a tiny mode: a 1+1 cluster under a mixed load (chat
and completions, streamed or not, some streams cancelled) for half a minute, memory sampled per
process, and every KV block free once the load stops."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


def test_the_soak_benchmark_samples_every_process_and_ends_with_every_block_free():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--minutes", "0.4", "--warmup-minutes", "0.1",
         "--interval", "2", "--concurrency", "2", "--no-results"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    processes = {line.split()[0] for line in run.stdout.splitlines() if line.split()[:1]}
    assert {"decode:decode-0", "prefill:prefill-0", "router", "redis-server", "up"} <= processes, run.stdout
    summary = re.search(r"- requests: (\d+) ok, (\d+) failed", run.stdout)
    assert summary is not None and int(summary[1]) > 0 and int(summary[2]) == 0, run.stdout
    assert "- blocks all free once idle: yes" in run.stdout, run.stdout
