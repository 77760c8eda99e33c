"""benchmarks/cpu_attention.py and benchmarks/int4_linear.py run (their --quick mode: both parts,
tiny sizes, nothing written; cpu_attention.py also with --baseline HEAD, the kernel's source at
the checkout's commit built beside it). The figures themselves are the scripts' to measure, not a
test's to assert."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_kernels.int4_matmul import load_int4_kernel

ROOT = Path(__file__).resolve().parents[2]
NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
NO_GIT = shutil.which("git") is None or not (ROOT / ".git").exists()


@pytest.mark.parametrize("script, expected, skip_reason", [
    ("cpu_attention.py --baseline HEAD", ("torch path us/layer", "HEAD kernel us/layer", "kernel / HEAD",
                                          "C kernel step ms"),
     "no C compiler" if NO_COMPILER else "no git checkout" if NO_GIT else None),
    ("int4_linear.py", ("torch int4 ms", "C int8 act ms", "C kernel step ms", "C int8 act step ms", "C q8 int8 act ms"),
     None if load_int4_kernel()[0] is not None and load_int4_kernel()[0].int8x_supported
     and load_int4_kernel()[0].bf16_supported
     else f"the table compares both C int4 paths (AVX512-BF16 and -VNNI): {load_int4_kernel()[1] or 'not on this CPU'}"),
])
def test_quick_run_prints_both_tables(script, expected, skip_reason):
    if skip_reason:
        pytest.skip(skip_reason)
    results = ROOT / "benchmarks" / "RESULTS.md"
    before = results.read_text()
    name, *flags = script.split()
    done = subprocess.run([sys.executable, f"benchmarks/{name}", "--quick", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(text in done.stdout for text in expected)
    assert results.read_text() == before  # --quick appends nothing
