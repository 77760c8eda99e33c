"""benchmarks/core_interference.py runs end to end in its tiny mode: a bare engine decodes on
one core while a second process is idle and then prefills on the other, and the script reports
both steps and their ratio (and leaves RESULTS.md alone)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "core_interference.py"


def test_the_core_interference_benchmark_runs_quick():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this benchmark pins two processes to two cores; this machine lets the tests use one")
    results = REPO / "benchmarks" / "RESULTS.md"
    before = results.read_bytes()
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick"], cwd=REPO, capture_output=True, text=True,
                         timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"round 1 idle: decode step median \d+\.\d+ ms", run.stdout), run.stdout
    assert re.search(r"round 1 prefilling: decode step median \d+\.\d+ ms", run.stdout), run.stdout
    assert re.search(r"prefilling / idle, the rounds. steps pooled: median \d+\.\d\dx", run.stdout)
    assert results.read_bytes() == before
