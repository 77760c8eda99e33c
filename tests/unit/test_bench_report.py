"""pdserve bench's output: vLLM's result block labels and JSON field names, exactly."""

from __future__ import annotations

import math
from dataclasses import replace

from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.report import RunInfo, failure_lines, result_block, result_json, result_path
from pdserve.bench.runner import RunResult

OUTPUTS = [
    RequestOutput(True, prompt_len=10, output_tokens=3, ttft=0.1, itl=(0.05, 0.05), latency=0.2, start_time=0.0,
                  generated_text="abc"),
    RequestOutput(False, error="HTTP 503: every decode worker is full", prompt_len=10, start_time=0.1),
]
RUN = RunResult(OUTPUTS, duration_s=2.0, cpu_s=0.5)
INFO = RunInfo("openai", "SmolLM2-135M-Instruct", "/m.gguf", 2, math.inf, 1.0, 4)

VLLM_FIELDS = {  # what `vllm bench serve --save-result --save-detailed` writes for a generation run
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
    "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
} | {f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std")}


def test_json_has_vllms_fields_plus_p90_p99_client_cpu_and_resends():
    result = result_json(compute_metrics(OUTPUTS, 2.0, [99.0]), RUN, INFO, goodput=False)
    percentiles = {f"p{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in ("90", "99")}
    assert set(result) == VLLM_FIELDS | percentiles | {"client_cpu_percent", "client_cpu_seconds", "resent"}
    assert result["resent"] == 0
    assert (result["request_rate"], result["request_goodput"], result["client_cpu_percent"]) == ("inf", None, 25.0)
    assert result["errors"] == ["", "HTTP 503: every decode worker is full"]
    assert (result["output_lens"], result["itls"], result["input_lens"]) == ([3, 0], [[0.05, 0.05], []], [10, 10])
    assert (result["completed"], result["failed"], result["p99_ttft_ms"]) == (1, 1, 100.0)


def test_extra_metric_percentiles_are_written_with_vllms_key_format():
    result = result_json(compute_metrics(OUTPUTS, 2.0, [50.0, 99.9]), RUN, INFO, goodput=True)
    assert {"p50_ttft_ms", "p99.9_itl_ms", "p90_e2el_ms", "p99_tpot_ms"} <= set(result)
    assert result["request_goodput"] == 0.0


def test_result_block_uses_vllms_labels_and_layout():
    metrics = compute_metrics(OUTPUTS, 2.0, [99.0], {"ttft": 500})
    block = result_block(metrics, RUN, INFO, ["ttft", "tpot", "itl"], [99.0], goodput=True).splitlines()
    assert block[0] == "============ Serving Benchmark Result ============"
    assert block[1] == "Successful requests:                     1         "
    assert block[2] == "Failed requests:                         1         "
    assert block[3] == "Maximum request concurrency:             4         "
    assert block[4] == "Benchmark duration (s):                  2.00      "
    labels = [line.split(":")[0] for line in block[1:] if ":" in line]
    assert labels == [
        "Successful requests", "Failed requests", "Maximum request concurrency", "Benchmark duration (s)",
        "Total input tokens", "Total generated tokens", "Request throughput (req/s)", "Request goodput (req/s)",
        "Output token throughput (tok/s)", "Peak output token throughput (tok/s)", "Peak concurrent requests",
        "Total token throughput (tok/s)", "Client CPU use (% of one core)",
        "Mean TTFT (ms)", "Median TTFT (ms)", "P99 TTFT (ms)", "Mean TPOT (ms)", "Median TPOT (ms)",
        "P99 TPOT (ms)", "Mean ITL (ms)", "Median ITL (ms)", "P99 ITL (ms)"]
    assert "---------------Time to First Token----------------" in block
    assert block[-1] == "=" * 50


def test_failures_are_counted_with_their_first_messages():
    assert failure_lines(RUN) == ["1 of 2 requests failed; the first 1:",
                                  "  error 0: HTTP 503: every decode worker is full"]


def test_default_result_filename_follows_vllm():
    assert str(result_path(INFO, "out", None, "20260101-000000")) == (
        "out/openai-infqps-concurrency4-SmolLM2-135M-Instruct-20260101-000000.json")
    assert str(result_path(INFO, None, "r.json", "d")) == "r.json"


def test_resends_are_shown_and_saved_only_as_counted():
    resent = [replace(OUTPUTS[0], resent=2), OUTPUTS[1]]
    run = replace(RUN, outputs=resent)
    metrics = compute_metrics(resent, 2.0, [99.0])
    block = result_block(metrics, run, INFO, ["ttft"], [99.0], goodput=False).splitlines()
    assert block[3] == "Resent after a dropped connection:       2         "
    assert result_json(metrics, run, INFO, goodput=False)["resent"] == 2
    assert not any(line.startswith("Resent") for line in result_block(
        compute_metrics(OUTPUTS, 2.0, [99.0]), RUN, INFO, ["ttft"], [99.0], goodput=False).splitlines())
