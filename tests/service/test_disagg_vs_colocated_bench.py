"""benchmarks/disagg_vs_colocated.py runs end to end in its --quick mode for the two setups the
bursts goal compares: steady short chats, then short chats with bursts of long prompts, through
a disaggregated cluster (prefill and decode pinned a core each) and a colocated one, with the
per-round ratio, the goal line and the gaps split by what the long prompts were doing. The
workers run the GGUF's int4 blocks with int8 activations (the fast path on a CPU without
AVX512-BF16, where auto is dense float32), and the method says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]


def test_the_bursts_benchmark_measures_both_setups_in_a_quick_run():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "disagg_vs_colocated.py"), "--quick", "--repeat", "1",
         "--setups", "disaggregated,colocated", "--dtype", "bfloat16", "--quantization", "gguf",
         "--int4-activations", "int8"],
        cwd=REPO, capture_output=True, text=True, timeout=840)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:2] in (["disaggregated", "1"], ["colocated", "1"])}
    assert sorted(rows) == ["colocated", "disaggregated"], out[-3000:]
    for row in rows.values():
        assert row[-1] == "0/0/0", out[-3000:]  # failed: steady / short chats with bursts / the bursts
    assert "goal disaggregated ITL p99 with bursts <= 1.2x steady: median" in out, out[-3000:]
    assert "the bursts phase's short-chat gaps by what the long prompts were doing" in out, out[-3000:]
    assert "gaps by the decode batch they fell in (rounds pooled)" in out, out[-3000:]
    assert "RESULTS.md left alone" in out, out[-3000:]
    assert "--dtype bfloat16 --quantization gguf --int4-activations int8" in out, out[-3000:]
