"""pdserve bench's token delivery delay (issue 16 item 4): each token's sample time from the
server's `pdserve_sampled_at` against its arrival here; reported (block and JSON) only when the
server sent the times."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.bench.client import RequestOutput, _Stream
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.report import RunInfo, result_block, result_json
from pdserve.bench.runner import RunResult
from pdserve.bench.sse import parse_chunk

INFO = RunInfo("openai", "SmolLM2-135M-Instruct", "/m.gguf", 1, math.inf, 1.0, None)


def _chunk(text: str, sampled_at=None, finish=None) -> str:
    body = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if sampled_at is not None:
        body["pdserve_sampled_at"] = sampled_at
    return json.dumps(body)


def test_a_chunk_with_sample_times_is_read_and_a_malformed_one_is_ignored():
    assert parse_chunk(_chunk("a", [10.0, 10.5])).sampled_at == (10.0, 10.5)
    assert parse_chunk(_chunk("a", ["x"])).sampled_at == ()
    assert parse_chunk(_chunk("a")).sampled_at == ()


def test_each_tokens_delay_is_its_arrival_minus_its_sample_time():
    stream = _Stream(start=0.0, prompt_len=3)
    stream.add(_chunk("a", [100.0]), now=0.1, wall=100.004)
    stream.add(_chunk("bc", [100.010, 100.012], finish="length"), now=0.2, wall=100.020)
    assert stream.output().delivery == pytest.approx((0.004, 0.010, 0.008))


def _outputs(delivery: tuple[float, ...]) -> list[RequestOutput]:
    return [RequestOutput(True, prompt_len=3, output_tokens=3, ttft=0.1, itl=(0.05, 0.05), latency=0.2,
                          delivery=delivery)]


def test_delivery_delay_is_reported_in_the_block_and_json_when_the_server_sent_times():
    outputs = _outputs((0.004, 0.010, 0.008))
    metrics = compute_metrics(outputs, 1.0, [99.0])
    run = RunResult(outputs, duration_s=1.0, cpu_s=0.1)
    block = result_block(metrics, run, INFO, ["ttft"], [99.0], goodput=False).splitlines()
    at = block.index("-----Token Delivery Delay (sample -> client)------")
    assert block[at + 1:at + 4] == ["Mean delivery (ms):                      7.33      ",
                                    "Median delivery (ms):                    8.00      ",
                                    "P99 delivery (ms):                       9.96      "]
    result = result_json(metrics, run, INFO, goodput=False)
    assert result["mean_delivery_ms"] == pytest.approx(22 / 3)
    assert (result["median_delivery_ms"], result["p99_delivery_ms"]) == pytest.approx((8.0, 9.96))
    assert result["deliveries"] == [[0.004, 0.010, 0.008]]  # per request, per token: which were late


def test_without_sample_times_nothing_about_delivery_is_reported():
    outputs = _outputs(())
    metrics = compute_metrics(outputs, 1.0, [99.0])
    run = RunResult(outputs, duration_s=1.0, cpu_s=0.1)
    assert metrics.delivery is None
    assert "delivery" not in result_block(metrics, run, INFO, ["ttft"], [99.0], goodput=False)
    assert not [k for k in result_json(metrics, run, INFO, goodput=False) if "delivery" in k]
