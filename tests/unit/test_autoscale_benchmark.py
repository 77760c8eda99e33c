"""benchmarks/autoscale.py's report, from windows and request outputs given here (no cluster):
TTFT p99 before and after against the SLO, and the plans with their arithmetic."""

from __future__ import annotations

from benchmarks.autoscale import parse_args, report, up_flags, verdict
from benchmarks.scale_under_load import Window
from pdserve.bench.client import RequestOutput

WINDOWS = [Window("before", "1+1", 0.0, 10.0), Window("scaling", "1+1 -> 2+1", 10.0, 20.0),
           Window("after", "2+1", 20.0, 30.0)]
PLAN = {"current": {"prefill": 1, "decode": 1}, "recommended": {"prefill": 2, "decode": 1},
        "reasons": {"prefill": "400.0 prompt tok/s over 240.0 tok/s per worker", "decode": "idle"},
        "arithmetic": ["prefill: ceil(400.0 / 240.0) = 2 prefill workers"]}


def outputs(ttfts_before, ttfts_after) -> list[RequestOutput]:
    return ([RequestOutput(True, ttft=t, latency=t + 0.1, start_time=1.0 + i) for i, t in enumerate(ttfts_before)]
            + [RequestOutput(True, ttft=t, latency=t + 0.1, start_time=21.0 + i) for i, t in enumerate(ttfts_after)])


def test_the_verdict_compares_ttft_p99_before_and_after_with_the_slo():
    args = parse_args(["--slo-ttft-ms", "2000"])
    assert verdict(args, WINDOWS, outputs([5.0] * 5, [1.0] * 5)) == \
        "- TTFT p99: before 5000 ms, after 1000 ms (SLO 2000 ms: met after)"
    assert verdict(args, WINDOWS, outputs([5.0] * 5, [3.0] * 5)).endswith("(SLO 2000 ms: not met after)")


def test_the_report_carries_the_plans_arithmetic_and_the_load_average():
    body = report(parse_args([]), WINDOWS, [PLAN], outputs([5.0], [1.0]), (3.5, 2.25))
    assert "- load average (1 min) at start 3.50, at end 2.25" in body
    assert ("- plan when the autoscaler acted: current 1+1, recommended 2+1 (prefill: 400.0 prompt tok/s over "
            "240.0 tok/s per worker; decode: idle)") in body
    assert "    - prefill: ceil(400.0 / 240.0) = 2 prefill workers" in body


def test_the_tiny_mode_is_short_and_passes_the_planner_flags_to_pdserve_up():
    args = parse_args(["--tiny"])
    assert (args.rate, args.window, args.plan_window) == (0.5, 10.0, 10.0)
    flags = up_flags(args)
    assert flags[flags.index("--plan-window") + 1] == "10" and "--autoscale" in flags
