"""benchmarks/gpu_check.py, the GPU path's one-run check, runs end to end on the CPU in a tiny
mode (--device cpu: the same script, no kernels): its prepare step writes the 30 prompts and the
tokenizer folder, and the engine and gloo-cluster stages agree with each other and with HF
transformers on the SmolLM2-shaped random model it writes. On a GPU the same command with
--device cuda is what benchmarks/RESULTS.md reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_runs_its_cpu_dry_run(tmp_path):
    prepared = subprocess.run([sys.executable, str(SCRIPT), "prepare", "--out", str(tmp_path / "in")],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert len(json.loads((tmp_path / "in" / "prompts.json").read_text())) == 30
    assert (tmp_path / "in" / "tokenizer" / "tokenizer.json").is_file()

    run = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--inputs", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
         "--device", "cpu", "--num-prompts", "2", "--blocks", "256", "--engine-dtypes", "float32",
         "--stages", "engine,cluster-gloo"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    engine = results["engine"]
    assert engine["float32"]["identical"] == engine["float32"]["prompts"] == 2
    assert engine["float32_vs_hf"]["identical"] == 2
    cluster = results["cluster-gloo"]
    assert cluster["errors"] == [] and cluster["paths"] == ["disaggregated"], cluster
    assert cluster["identical_to_engine"] == 2, cluster
    assert all(free == total and reserved == 0 for total, free, reserved in cluster["pools_after"].values())
