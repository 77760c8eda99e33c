"""The dashboard's history: percentiles from histogram buckets, one sample from two readings,
and the bounded ring's column form for the charts. Exact values throughout."""

from __future__ import annotations

import math

import pytest

from router.ops.dashboard.history import History, Reading, bucket_delta, quantile, sample

INF = math.inf
BUCKETS = ((0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0))


@pytest.mark.parametrize("q, expected", [(0.5, 0.4), (0.99, 0.9875), (0.1, 0.05), (1.0, 1.0)])
def test_quantile_interpolates_inside_the_bucket_holding_the_rank(q, expected):
    assert quantile(q, BUCKETS) == pytest.approx(expected, abs=1e-12)


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound():
    assert quantile(0.5, ((0.1, 0.0), (0.25, 1.0), (INF, 4.0))) == 0.25


def test_quantile_of_no_observations_is_none():
    assert quantile(0.5, ((0.1, 0.0), (INF, 0.0))) is None
    assert quantile(0.5, ()) is None


def test_bucket_delta_subtracts_the_older_cumulative_counts():
    assert bucket_delta(BUCKETS, ((0.1, 1.0), (0.5, 1.0), (1.0, 4.0), (INF, 4.0))) == (
        (0.1, 1.0), (0.5, 5.0), (1.0, 6.0), (INF, 6.0))


def test_sample_turns_two_readings_into_rates_percentiles_usage_speed_and_fallbacks():
    old = Reading(at_unix=100.0, finished=10, prompt_tokens=1000, generation_tokens=500,
                  latency={"ttft": ((0.1, 0.0), (0.5, 0.0), (1.0, 0.0), (INF, 0.0))},
                  links={"prefill-0->decode-0": (1_000_000, 0.001)}, fallbacks={"local_prefill": 1})
    new = Reading(at_unix=110.0, finished=30, prompt_tokens=5000, generation_tokens=2500,
                  latency={"ttft": BUCKETS}, kv_usage={"decode": 0.25, "prefill": 0.0},
                  links={"prefill-0->decode-0": (3_000_000, 0.002), "prefill-0->decode-1": (7, 0.5)},
                  fallbacks={"local_prefill": 3, "prefill_failed": 0})
    values = sample(old, new)
    assert values["request_rate"] == 2.0
    assert values["prompt_tokens_per_s"] == 400.0
    assert values["generation_tokens_per_s"] == 200.0
    assert values["ttft_p50_ms"] == pytest.approx(400.0)
    assert values["ttft_p99_ms"] == pytest.approx(987.5)
    assert values["itl_p50_ms"] is None and values["e2e_p99_ms"] is None  # nothing observed
    assert values["kv_usage.decode"] == 25.0 and values["kv_usage.prefill"] == 0.0
    assert values["transfer_gbps.prefill-0->decode-0"] == pytest.approx(2.0)  # 2 MB in 1 ms
    assert values["transfer_gbps.prefill-0->decode-1"] == pytest.approx(7 / 0.5 / 1e9)  # new link
    assert values["fallbacks.local_prefill"] == pytest.approx(12.0)  # 2 in 10 s = 12 / min
    assert values["fallbacks.prefill_failed"] == 0.0


def test_a_link_that_moved_nothing_in_the_window_has_no_speed_not_zero():
    old = Reading(at_unix=1.0, links={"p->d": (10, 1.0)})
    new = Reading(at_unix=2.0, links={"p->d": (10, 1.0)})
    assert sample(old, new)["transfer_gbps.p->d"] is None


def test_the_first_sample_has_no_rates():
    only = Reading(at_unix=5.0, finished=3)
    values = sample(only, only)
    assert values["request_rate"] is None and values["ttft_p50_ms"] is None


def test_history_keeps_only_the_last_capacity_samples():
    history = History(capacity=900)
    for t in range(1000):
        history.append(float(t), {"request_rate": float(t)})
    body = history.to_json()
    assert len(history) == 900
    assert body["t"][0] == 100.0 and body["t"][-1] == 999.0
    assert body["series"]["request_rate"][:2] == [100.0, 101.0]
    assert (body["interval_s"], body["capacity"]) == (1.0, 900)


def test_history_columns_pad_a_series_that_appeared_later_with_null_and_round_to_four_digits():
    history = History(capacity=10)
    history.append(1.0, {"request_rate": 1 / 3})
    history.append(2.0, {"request_rate": 12345.678, "transfer_gbps.p->d": 0.000123456})
    history.append(3.0, {"request_rate": None, "transfer_gbps.p->d": 0.0})
    assert history.to_json() == {"interval_s": 1.0, "capacity": 10, "t": [1.0, 2.0, 3.0], "series": {
        "request_rate": [0.3333, 12350.0, None], "transfer_gbps.p->d": [None, 0.0001235, 0.0]}}


def test_history_since_returns_only_newer_samples():
    history = History(capacity=10)
    for t in (1.0, 2.0, 3.0):
        history.append(t, {"request_rate": t})
    assert history.to_json(since=2.0)["t"] == [3.0]
    assert history.to_json(since=3.0) == {"interval_s": 1.0, "capacity": 10, "t": [], "series": {}}


def test_history_refuses_a_capacity_below_one():
    with pytest.raises(ValueError, match="history capacity must be >= 1, got 0"):
        History(capacity=0)
