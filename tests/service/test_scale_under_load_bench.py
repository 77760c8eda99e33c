"""benchmarks/scale_under_load.py runs end to end in a tiny mode: a 1+1 cluster under open-loop
load is scaled to 2+2 and back through the roles API, and the report has its five windows, each
with its workers, and no request lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


def test_the_scale_under_load_benchmark_scales_up_and_down_without_losing_a_request(tmp_path):
    out = tmp_path / "run.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scale_under_load.py"), "--window", "3", "--warmup", "1",
         "--rate", "1", "--input-words", "8", "--output-len", "4", "--kv-cache-memory", "128MiB",
         "--out", str(out), "--no-results"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    windows = json.loads(out.read_text())["windows"]
    assert [(w["name"], w["shape"]) for w in windows] == [
        ("before", "1+1"), ("scale-up", "1+1 -> 2+2"), ("after up", "2+2"), ("scale-down", "2+2 -> 1+1"),
        ("after down", "1+1")]
    summary = re.search(r"- requests: (\d+) sent, (\d+) ok, (\d+) failed", run.stdout)
    assert summary is not None, run.stdout
    sent, ok, failed = map(int, summary.groups())
    assert sent > 0 and ok == sent and failed == 0, run.stdout
