"""The planner's pure model: exact counts and arithmetic for long prompts, long outputs, idle,
SLO misses and bounds."""

from __future__ import annotations

import pytest

from router.ops.planner.model import PlanInputs, PlanSettings, RoleBounds, recommend

SETTINGS = PlanSettings(slo_ttft_ms=1000, slo_itl_ms=50, target_utilization=0.8,
                        bounds=RoleBounds(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8))


def inputs(**overrides) -> PlanInputs:
    base = dict(window_s=60, current_prefill=1, current_decode=1, prefill_tokens_per_busy_s=450.0,
                decode_tokens_per_busy_s=200.0, kv_tokens_per_decode_worker=16384)
    return PlanInputs(**(base | overrides))


def test_long_prompts_recommend_more_prefill_and_not_more_decode():
    r = recommend(inputs(prompt_tokens_per_s=800.0, queued_prefill_tokens=720, output_tokens_per_s=20.0,
                         mean_request_tokens=1010, decode_running=2, decode_batch=2, prefill_utilization=1.0,
                         decode_utilization=0.1), SETTINGS)
    assert (r.prefill, r.decode) == (3, 1)
    assert r.arithmetic[:3] == (
        "prefill: prompt tokens arrive at 800.0 tok/s (the larger of 800.0 at this router and 0.0 computed by the "
        "prefill workers), + 720 queued / 60 s window = 812.0 tok/s",
        "prefill: one prefill worker computes 450.0 tok/s busy; at 80% target utilisation 360.0 tok/s",
        "prefill: ceil(812.0 / 360.0) = 3 prefill workers",
    )
    assert r.reasons == {"prefill": "812.0 prompt tok/s over 360.0 tok/s per worker",
                         "decode": "20.0 output tok/s over 160.0 tok/s per worker"}


def test_long_outputs_recommend_more_decode_and_not_more_prefill():
    r = recommend(inputs(prompt_tokens_per_s=40.0, output_tokens_per_s=500.0, mean_request_tokens=520,
                         decode_running=16, decode_batch=16, prefill_utilization=0.05, decode_utilization=1.0),
                  SETTINGS)
    assert (r.prefill, r.decode) == (1, 4)
    assert "decode: ceil(500.0 / 160.0) = 4 decode workers" in r.arithmetic
    assert r.reasons["decode"] == "500.0 output tok/s over 160.0 tok/s per worker"


def test_traffic_through_other_routers_counts_through_what_the_workers_computed():
    """With several router processes, this one sees only its share; the workers see it all."""
    r = recommend(inputs(prompt_tokens_per_s=200.0, prefill_computed_tokens_per_s=700.0,
                         output_tokens_per_s=10.0, decode_generated_tokens_per_s=300.0, decode_running=3,
                         decode_batch=3), SETTINGS)
    assert (r.prefill, r.decode) == (2, 2)  # ceil(700 / 360), ceil(300 / 160)
    assert r.reasons == {"prefill": "700.0 prompt tok/s over 360.0 tok/s per worker",
                         "decode": "300.0 output tok/s over 160.0 tok/s per worker"}


def test_idle_recommends_the_minimums():
    r = recommend(inputs(current_prefill=3, current_decode=2), SETTINGS)
    assert (r.prefill, r.decode) == (1, 1)
    assert r.reasons == {
        "prefill": "idle: no prompt tokens arrived or queued; held to min 1 (--autoscale-min-prefill)",
        "decode": "idle: no output tokens arrived, no request decoding; held to min 1 (--autoscale-min-decode)"}


def test_ttft_over_its_slo_with_busy_prefill_workers_asks_for_one_more():
    r = recommend(inputs(current_prefill=2, prompt_tokens_per_s=300.0, ttft_p99_ms=2500.0,
                         prefill_utilization=0.9), SETTINGS)
    assert r.prefill == 3  # ceil(300 / 360) = 1 by rate; the SLO miss wins
    assert r.reasons["prefill"] == "TTFT p99 2500 ms over the 1000 ms SLO"


def test_ttft_over_its_slo_with_idle_prefill_workers_is_not_a_prefill_problem():
    r = recommend(inputs(prompt_tokens_per_s=100.0, ttft_p99_ms=2500.0, prefill_utilization=0.2), SETTINGS)
    assert r.prefill == 1
    assert "prefill: TTFT p99 2500 ms > SLO 1000 ms; prefill workers 20% busy (below target: not the prefill side)" \
        in r.arithmetic


def test_itl_over_its_slo_sizes_decode_by_the_streams_a_worker_holds_within_it():
    r = recommend(inputs(output_tokens_per_s=100.0, decode_running=12, decode_batch=12, itl_p99_ms=120.0,
                         decode_utilization=0.95), SETTINGS)
    # one worker holds floor(12 x 50 / 120) = 5 streams within the SLO: ceil(12 / 5) = 3
    assert r.decode == 3
    assert r.reasons["decode"] == "ITL p99 120 ms over the 50 ms SLO"


def test_kv_concurrency_sizes_decode_when_requests_are_long():
    r = recommend(inputs(output_tokens_per_s=50.0, mean_request_tokens=4096, decode_running=10, decode_batch=10,
                         decode_utilization=0.5), SETTINGS)
    # 16384 / 4096 = 4 requests per worker, x 0.8 = 3.2: ceil(10 / 3.2) = 4
    assert r.decode == 4
    assert r.reasons["decode"] == "10.0 decoding requests over a KV concurrency of 3.2 per worker"


def test_recommendations_are_held_within_the_bounds():
    settings = PlanSettings(bounds=RoleBounds(min_prefill=2, max_prefill=2, min_decode=1, max_decode=3))
    r = recommend(inputs(prompt_tokens_per_s=5000.0, output_tokens_per_s=5000.0, decode_running=4), settings)
    assert (r.prefill, r.decode) == (2, 3)
    assert r.reasons["decode"].endswith("; held to max 3 (--autoscale-max-decode)")
    assert r.arithmetic[-1] == "decode: recommend 3 (min 1, max 3)"


def test_a_role_never_measured_keeps_its_current_count():
    r = recommend(inputs(current_prefill=2, prompt_tokens_per_s=100.0, prefill_tokens_per_busy_s=None), SETTINGS)
    assert r.prefill == 2
    assert r.reasons["prefill"] == "no prefill throughput measured yet: keep the current count"


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_utilization=0), "target utilization must be in (0, 1]; got 0"),
    (dict(slo_ttft_ms=-5), "slo_ttft_ms must be > 0; got -5"),
])
def test_settings_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError) as info:
        PlanSettings(**kwargs)
    assert str(info.value) == message


def test_bounds_refuse_a_min_above_the_max():
    with pytest.raises(ValueError) as info:
        RoleBounds(min_decode=3, max_decode=2)
    assert str(info.value) == "autoscale decode bounds must satisfy 0 <= min <= max, max >= 1; got min 3, max 2"
