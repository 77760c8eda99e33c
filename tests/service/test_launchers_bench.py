"""benchmarks/launchers.py runs end to end for one round: `pdserve up` with local processes, then
on a local Ray instance it starts itself, each answering a real completion, with every
component's memory found among the processes under the command, and the table printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]


def test_the_launchers_benchmark_starts_both_launchers_and_finds_each_component():
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launchers.py"), "--rounds", "1", "--no-results"],
                         cwd=REPO, capture_output=True, text=True, timeout=840)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    for launcher in ("local", "ray"):
        line = next((x for x in out.splitlines() if x.startswith(f"round 1 {launcher}: first answer ")), None)
        assert line is not None, out[-3000:]
        for component in ("router", "prefill", "decode", "redis", "launcher"):
            mb = re.search(rf"\b{component} (\d+) MB", line)
            assert mb is not None and int(mb.group(1)) > 0, line  # each component's processes were found
    assert re.search(r"time to first answer \(s\) +[\d.]+ +[\d.]+ +[\d.]+", out), out[-3000:]
    assert re.search(r"RSS ray itself \(MB\) +0 +[1-9]\d*", out), out[-3000:]  # Ray's own processes, on Ray only
    assert "(RESULTS.md left alone)" in out, out[-3000:]
