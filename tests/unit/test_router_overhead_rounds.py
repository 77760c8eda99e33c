"""benchmarks/router_overhead.py --rounds: rounds merge into one table row, and the goal line
gives the spread of the per-round ratios, so one noisy round on a shared machine cannot decide."""

from benchmarks.router_overhead import Measured, PathRun, goal_lines, merged, parse_args, timed_count


def run(n: int, seconds: float, router_cpu_s: float = 0.0, doubles_cpu_s: float = 0.0) -> PathRun:
    return PathRun([0.001 * (i + 1) for i in range(n)], 0, seconds, 0.0, router_cpu_s, doubles_cpu_s)


def test_rounds_merge_into_all_latencies_and_the_totals():
    both = merged([run(2, 1.0, 0.5, 0.25), run(4, 1.0, 0.3, 0.5)])
    assert both.latencies_s == [0.001, 0.002, 0.001, 0.002, 0.003, 0.004]
    assert (both.seconds, both.router_cpu_s, both.doubles_cpu_s, both.req_per_s) == (2.0, 0.8, 0.75, 3.0)


def test_a_line_gives_what_the_shared_cores_spend_per_request_with_each_router():
    direct = run(10, 1.0)
    ours = Measured("pdserve-x2", 16, (run(100, 1.0, 0.09, 0.011),), direct)
    peer = Measured("vllm-router", 16, (run(100, 1.0, 0.04, 0.027),), direct)
    line = next(g for g in goal_lines([ours, peer]) if g.startswith("CPU per request"))
    assert line == ("CPU per request at 16 in flight, router + doubles + client (what the shared cores spend "
                    "per request, in ms): pdserve-x2 1.01, vllm-router 0.67")


def test_the_req_per_s_goal_line_gives_the_spread_of_the_per_round_ratios():
    direct = run(10, 1.0)
    ours = Measured("pdserve", 16, (run(90, 1.0), run(110, 1.0)), direct)
    peer = Measured("vllm-router", 16, (run(100, 1.0), run(100, 1.0)), direct)
    line = next(g for g in goal_lines([ours, peer]) if g.startswith("pdserve / vllm-router"))
    assert line == "pdserve / vllm-router req/s at 16 in flight: 1.00x (met; goal >= 1.0x), per round: 0.90-1.10x"


def test_one_round_is_the_default_and_rounds_must_be_positive():
    assert parse_args([]).rounds == 1
    assert parse_args(["--rounds", "3"]).rounds == 3


def test_high_concurrency_is_timed_over_more_requests_than_low():
    args = parse_args([])
    assert (args.requests, args.requests_per_flight) == (300, 100)
    assert [timed_count(args, c) for c in (1, 2, 4, 16)] == [300, 300, 400, 1600]
    assert timed_count(parse_args(["--requests-per-flight", "0"]), 16) == 300
