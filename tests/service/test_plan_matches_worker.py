"""`pdserve plan` and a real `pdserve decode` process, given the same flags, report the same
capacity: the worker's startup log line and its /metrics equal plan's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.worker_process import stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300  # a cold weights cache dequantizes the GGUF first

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)

SETTINGS = [
    ["--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--block-size", "16"],
    ["--dtype", "float32", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "100MiB", "--max-model-len", "4096",
     "--block-size", "32", "--no-enable-prefix-caching"],
]


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", *args]


def plan_json(flags: list[str]) -> dict:
    done = subprocess.run(pdserve("plan", "--json", *flags), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def start_decode_worker(flags: list[str], tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    ready, log = tmp / "ready", tmp / "worker.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            pdserve("decode", "--num-threads", "1", "--ready-file", str(ready), *flags),
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return process, ready, log



def capacity_lines(log: Path) -> list[str]:
    return [line.split("engine.core: ", 1)[1] for line in log.read_text().splitlines()
            if "engine.core: KV cache: " in line]


def worker_samples(metrics_port: int) -> dict[str, tuple[dict, float]]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples}


@pytest.mark.parametrize("flags", SETTINGS, ids=["float32-256MiB", "fp8-100MiB-block32"])
def test_plan_equals_the_decode_workers_logged_capacity_and_metrics(tmp_path, flags):
    planned = plan_json(flags)["capacity"]
    process, ready, log = start_decode_worker(flags, tmp_path)
    try:
        metrics_port = wait_ready(process, ready, log, START_TIMEOUT_S)[1]
        assert capacity_lines(log) == [planned["log_line"]]
        samples = worker_samples(metrics_port)
    finally:
        stop(process)
    assert process.returncode is not None
    labels, value = samples["pdserve_kv_capacity_tokens"]
    assert (labels["role"], value) == ("decode", planned["num_tokens"])
    assert samples["pdserve_kv_bytes_per_token"][1] == planned["bytes_per_token"]
    assert samples["pdserve_max_concurrency"][1] == planned["max_concurrency"]
    info_labels, info_value = samples["vllm:cache_config_info"]
    assert info_value == 1.0
    assert (info_labels["role"], info_labels["num_gpu_blocks"], info_labels["block_size"]) == (
        "decode", str(planned["num_blocks"]), str(planned["block_size"]))
    assert info_labels["enable_prefix_caching"] == str("--no-enable-prefix-caching" not in flags)


def test_plan_numbers_for_the_first_setting_are_the_expected_ones():
    """The shared numbers above are not vacuous: 256 MiB // (46,080 B x 16) = 364 blocks."""
    planned = plan_json(SETTINGS[0])["capacity"]
    assert (planned["num_blocks"], planned["num_tokens"], planned["max_concurrency"]) == (364, 5824, 2.84375)
