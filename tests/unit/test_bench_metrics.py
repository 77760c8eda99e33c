"""pdserve bench's numbers on fixed timings: vLLM's definitions, exact values."""

from __future__ import annotations

import pytest

from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import compute_metrics, metric_stats, peak_concurrency, percentile_word, tokens_per_second

# Three successful requests and one failure; times in seconds.
#   a: starts 0.0, ttft 0.1, 3 tokens (gaps 0.05, 0.05), ends 0.2 -> tpot 0.05
#   b: starts 0.5, ttft 0.3, 2 tokens (gap 0.2),        ends 1.0 -> tpot 0.2
#   c: starts 1.0, ttft 0.2, 1 token,                   ends 1.2 -> no tpot (goodput: 0)
A = RequestOutput(True, prompt_len=10, output_tokens=3, ttft=0.1, itl=(0.05, 0.05), latency=0.2, start_time=0.0)
B = RequestOutput(True, prompt_len=20, output_tokens=2, ttft=0.3, itl=(0.2,), latency=0.5, start_time=0.5)
C = RequestOutput(True, prompt_len=30, output_tokens=1, ttft=0.2, itl=(), latency=0.2, start_time=1.0)
FAILED = RequestOutput(False, error="HTTP 503: full", prompt_len=40, start_time=0.2)
OUTPUTS = [A, B, FAILED, C]


def test_totals_and_throughputs_count_only_successful_requests():
    m = compute_metrics(OUTPUTS, duration_s=2.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 6)
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (1.5, 3.0, 33.0)
    assert m.output_lens == (3, 2, 0, 1)


def test_latency_stats_in_ms_with_numpy_linear_percentiles():
    m = compute_metrics(OUTPUTS, duration_s=2.0, percentiles=[50.0, 99.0])
    ttft = m.stats["ttft"]  # 100, 300, 200 ms
    assert ttft.mean == pytest.approx(200.0) and ttft.median == pytest.approx(200.0)
    assert dict(ttft.percentiles) == pytest.approx({50.0: 200.0, 90.0: 280.0, 99.0: 298.0})
    tpot = m.stats["tpot"]  # 50, 200 ms (c has one token: no TPOT)
    assert (tpot.mean, tpot.median) == pytest.approx((125.0, 125.0))
    assert dict(tpot.percentiles)[90.0] == pytest.approx(185.0)
    itl = m.stats["itl"]  # 50, 50, 200 ms pooled
    assert (itl.mean, itl.median) == pytest.approx((100.0, 50.0))
    assert dict(itl.percentiles)[99.0] == pytest.approx(197.0)
    e2el = m.stats["e2el"]  # 200, 500, 200 ms
    assert (e2el.median, dict(e2el.percentiles)[90.0]) == pytest.approx((200.0, 440.0))


def test_goodput_counts_requests_meeting_every_slo():
    # ttft <= 250 ms keeps a, c; tpot <= 100 ms keeps a, c (c's TPOT counts as 0).
    assert compute_metrics(OUTPUTS, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 100}).request_goodput == 1.0
    # e2el <= 200 ms: a and c exactly at the limit count as good.
    assert compute_metrics(OUTPUTS, 2.0, goodput_slos_ms={"e2el": 200}).request_goodput == 1.0
    assert compute_metrics(OUTPUTS, 2.0, goodput_slos_ms={"ttft": 50}).request_goodput == 0.0
    assert compute_metrics(OUTPUTS, 2.0).request_goodput == 0.0


def test_unknown_goodput_metric_is_refused():
    with pytest.raises(ValueError, match="itl"):
        compute_metrics(OUTPUTS, 2.0, goodput_slos_ms={"itl": 10})


def test_a_metric_without_samples_reports_zero():
    s = metric_stats([], [99.0])
    assert (s.mean, s.median, s.std, s.percentiles) == (0.0, 0.0, 0.0, ((99.0, 0.0),))


def test_tokens_per_second_and_peak_concurrency():
    # token arrival: a 0.1, 0.15, 0.2; b 0.8, 1.0; c 1.2 -> buckets [0,1) 4, [1,2) 2
    assert tokens_per_second([A, B, C]) == (4, 2, 0)
    assert peak_concurrency([A, B, C]) == 1  # b ends at 1.0 exactly when c starts
    assert compute_metrics(OUTPUTS, 2.0).max_output_tokens_per_s == 4.0


def test_percentile_words_match_vllms_json_keys():
    assert [percentile_word(p) for p in (99.0, 90.0, 99.9, 50.0)] == ["99", "90", "99.9", "50"]
