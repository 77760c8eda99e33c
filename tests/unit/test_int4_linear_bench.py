"""benchmarks/int4_linear.py runs (its --quick mode: both parts, tiny sizes, nothing written).
The figures themselves are the script's to measure, not a test's to assert."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_kernels.int4_matmul import load_int4_kernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(load_int4_kernel()[0] is None, reason=f"no C int4 kernel here: {load_int4_kernel()[1]}")
def test_quick_run_prints_both_tables():
    results = ROOT / "benchmarks" / "RESULTS.md"
    before = results.read_text()
    done = subprocess.run([sys.executable, "benchmarks/int4_linear.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "torch int4 ms" in done.stdout and "C kernel step ms" in done.stdout
    assert results.read_text() == before  # --quick appends nothing
