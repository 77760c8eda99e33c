"""`pdserve plan --live URL` prints GET /v1/plan as text: counts, reasons, arithmetic, autoscale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.plan_live import render_plan
from tests.unit.test_plan_http import app
from tests.unit.router_doubles import call

ROOT = Path(__file__).resolve().parents[2]


def test_the_live_plan_prints_counts_reasons_and_the_arithmetic():
    body = call(app(), "GET", "/v1/plan").json()
    text = render_plan(body).splitlines()
    assert text[:4] == [
        "live plan over the last 60 s (SLO: TTFT p99 -, ITL p99 -)",
        "  role     current recommended  why",
        "  prefill        1           3  1000.0 prompt tok/s over 400.0 tok/s per worker",
        "  decode         1           1  2.0 output tok/s over 160.0 tok/s per worker",
    ]
    assert text[4] == "arithmetic:"
    assert "  prefill: ceil(1000.0 / 400.0) = 3 prefill workers" in text
    assert text[-1] == "autoscale: off (prefill 1..4, decode 1..4); last action: none yet"


def test_an_unreachable_router_is_one_line_and_exit_1():
    result = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--live", "http://127.0.0.1:9"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("pdserve plan --live: cannot reach the router at http://127.0.0.1:9: ")
