"""benchmarks/cpu_attention.py runs (its --quick mode: both parts, tiny sizes, nothing written).
The figures themselves are the script's to measure, not a test's to assert."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_quick_run_prints_both_tables():
    results = ROOT / "benchmarks" / "RESULTS.md"
    before = results.read_text()
    done = subprocess.run([sys.executable, "benchmarks/cpu_attention.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "torch path us/layer" in done.stdout and "C kernel step ms" in done.stdout
    assert results.read_text() == before  # --quick appends nothing
