"""benchmarks/vs_llamacpp.py runs end to end in its --quick mode: llama.cpp's llama-server, then
`pdserve up --colocated`, on the same GGUF and the same pinned cores, every workload answered in
full by both, the ratios and the batch-1 decode line printed, RESULTS.md left alone.

llama-server is built from source by benchmarks/peers/build_llamacpp.sh (about half an hour on
2 cores), which no test starts: this test runs where it has been built and skips, saying so,
where it has not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "benchmarks" / "peers" / "build_llamacpp.sh"
WORKLOADS = ("short chat", "long prompt", "mixed", "decode batch 1")


def built_llama_server() -> str | None:
    done = subprocess.run(["bash", str(BUILD), "--built-only"], capture_output=True, text=True, timeout=60)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None


@pytest.mark.skipif(built_llama_server() is None,
                    reason="llama-server is not built here (benchmarks/peers/build_llamacpp.sh builds it)")
def test_the_llamacpp_comparison_serves_every_workload_on_both_servers_in_a_quick_run():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vs_llamacpp.py"), "--quick"],
                         cwd=REPO, capture_output=True, text=True, timeout=840)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    for workload in WORKLOADS:
        for server in ("pdserve", "llama.cpp"):
            row = next((line for line in out.splitlines() if re.match(rf"{workload} +{re.escape(server)} ", line)),
                       None)
            assert row is not None, f"no {workload} row for {server}:\n{out[-3000:]}"
            assert row.split()[-1] == "0", row  # failed requests
        assert re.search(rf"^{workload} +pdserve/llama\.cpp +[\d.]+x", out, re.M), out[-3000:]
    assert re.search(r"decode tok/s at batch 1 \(1000 / mean ITL\): pdserve [\d.]+, llama\.cpp [\d.]+, "
                     r"ratio [\d.]+x", out), out[-3000:]
    assert "(quick/no-results run: RESULTS.md left alone)" in out, out[-3000:]
