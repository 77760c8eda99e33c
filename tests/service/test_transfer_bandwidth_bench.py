"""benchmarks/transfer_bandwidth.py runs end to end in a small mode: our gloo data plane against
a raw gloo send for one prompt size, and the layer-by-layer transfer against the one-shot one
(the share of the transfer hidden behind the prefill), on the real model's KV shape."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


def test_the_transfer_bandwidth_benchmark_reports_the_ratio_to_raw_gloo_and_the_overlap():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "transfer_bandwidth.py"), "--sizes", "64", "--repeat", "1",
         "--overlap-sizes", "128", "--skip-ttft", "--no-results"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"goal ours/raw >= 0\.80 at 64 tokens: [0-9.]+x -> (MET|NOT MET)", out), out[-3000:]
    hidden = re.search(r"overlap at 128 tokens .*: (-?[0-9]+)% of the one-shot transfer's time", out)
    assert hidden is not None, out[-3000:]
    assert -100 <= int(hidden.group(1)) <= 100, out[-3000:]
    assert "share of transfer hidden" in out and "TTFT, disaggregated vs colocated" not in out, out[-3000:]
