"""`pdserve bench` against a running `pdserve up` (the real default model): 24 random prompts
of 64 tokens complete with 16 output tokens each, and the result JSON has vLLM's fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.cluster import ROOT, start_cluster

pytestmark = pytest.mark.slow

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 24, 64, 16
SUMMARY_FIELDS = (
    "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "client_cpu_percent",
)
LATENCY_FIELDS = tuple(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
                       for stat in ("mean", "median", "std", "p90", "p99"))
PER_REQUEST_FIELDS = ("ttfts", "itls", "input_lens", "output_lens", "latencies", "start_times", "errors")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("up"), "--prefill", "1", "--decode", "1",
                      "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    try:
        yield c
    finally:
        c.stop()


def test_bench_completes_24_prompts_and_writes_vllm_fields(cluster, tmp_path):
    cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", cluster.base_url,
           "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
           "--random-output-len", str(OUTPUT_LEN), "--goodput", "ttft:600000", "tpot:600000",
           "--metric-percentiles", "90,99", "--save-result", "--result-dir", str(tmp_path),
           "--result-filename", "bench.json", "--plot", "--disable-tqdm"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "============ Serving Benchmark Result ============" in done.stdout
    assert f"{'Successful requests:':<40} {NUM_PROMPTS:<10}" in done.stdout

    result = json.loads((tmp_path / "bench.json").read_text())
    missing = [f for f in SUMMARY_FIELDS + LATENCY_FIELDS + PER_REQUEST_FIELDS if f not in result]
    assert not missing, missing
    assert (result["completed"], result["failed"], result["num_prompts"]) == (NUM_PROMPTS, 0, NUM_PROMPTS)
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # the random dataset ignores eos
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS  # the server's own prompt count
    assert result["errors"] == [""] * NUM_PROMPTS
    # One gap per streamed token after the first; a final token whose only text was the start of
    # a multi-byte character (random prompts make such tokens) is dropped by the detokenizer, as
    # vLLM does, so its chunk carries no text and the client counts no gap for it.
    gaps = [len(g) for g in result["itls"]]
    assert all(OUTPUT_LEN - 2 <= n <= OUTPUT_LEN - 1 for n in gaps), gaps
    assert gaps.count(OUTPUT_LEN - 1) >= NUM_PROMPTS - 2, gaps
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # generous SLOs
    assert result["backend"] == "openai" and result["request_rate"] == "inf"
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    assert result["client_cpu_percent"] > 0
    # token delivery delay: pdserve sends each token's sample time (the first token's at least)
    assert "-----Token Delivery Delay (sample -> client)------" in done.stdout
    assert 0 <= result["median_delivery_ms"] <= result["p99_delivery_ms"] <= result["p99_e2el_ms"]
    assert (tmp_path / "bench.latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "bench.tokens_per_s.png").stat().st_size > 0
