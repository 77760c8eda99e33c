"""benchmarks/autoscale.py runs end to end in its --tiny mode: `pdserve up --autoscale` under an
open-loop load, every request answered, the windows' TTFT table, the planner's plan with its
arithmetic, and the verdict line. Whether the autoscaler acts within the tiny run depends on how
busy the machine is, so either ending is accepted: the change (with a before and an after
window) or the run giving up with the plan it saw."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]


def test_the_autoscale_benchmark_reports_windows_plan_and_verdict_in_a_tiny_run():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "autoscale.py"), "--tiny", "--no-results"],
                         cwd=REPO, capture_output=True, text=True, timeout=840)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    sent = re.search(r"^- requests: (\d+) sent, (\d+) ok, 0 failed$", out, re.M)
    assert sent is not None and int(sent.group(1)) == int(sent.group(2)) > 0, out[-3000:]
    assert re.search(r"^- TTFT p99: before \S+ ms, after \S+ ms \(SLO 2000 ms: (met|not met) after\)$", out, re.M), \
        out[-3000:]
    plan = re.search(r"^- plan (when the autoscaler acted|when the run gave up): current \d\+\d, recommended \d\+\d",
                     out, re.M)
    assert plan is not None, out[-3000:]
    assert "    - prefill: " in out, out[-3000:]  # the plan's arithmetic
    assert "appended to" not in out, out[-3000:]
