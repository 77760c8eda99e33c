"""benchmarks/burst_gaps.py: short-chat gaps split by what the long prompts were doing."""

from __future__ import annotations

import math

import pytest

from benchmarks.burst_gaps import CLASSES, classify, gap_classes, gaps, windows


def bench_json(starts, ttfts, latencies, itls=None, errors=None) -> dict:
    n = len(starts)
    return {"start_times": list(starts), "ttfts": list(ttfts), "latencies": list(latencies),
            "itls": itls if itls is not None else [[] for _ in range(n)], "errors": errors or [""] * n}


def test_windows_are_prefill_then_decode_and_skip_failures():
    long = bench_json([10.0, 20.0], [2.0, 0.0], [3.0, 0.0], errors=["", "ReadTimeout"])
    assert windows(long) == ([(10.0, 12.0)], [(12.0, 13.0)])


def test_gaps_follow_the_first_token():
    short = bench_json([1.0], [0.5], [0.7], itls=[[0.1, 0.1]])
    assert [t for gap in gaps(short) for t in gap] == pytest.approx([1.5, 1.6, 1.6, 1.7])


def test_a_gap_overlapping_a_decode_window_is_decoding_even_if_also_arriving():
    # arriving 10-12 and 12.5-13.5, decoding 12-13 and 13.5-14.5
    long = bench_json([10.0, 12.5], [2.0, 1.0], [3.0, 2.0])
    short = bench_json([9.0], [0.5], [6.0],
                       itls=[[0.2,     # 9.5-9.7: neither
                              0.5,     # 9.7-10.2: arriving
                              2.0,     # 10.2-12.2: arriving and decoding -> decoding
                              1.0,     # 12.2-13.2: decoding
                              0.1,     # 13.2-13.3: the second prompt arriving
                              1.5]])   # 13.3-14.8: the second prompt decoding
    by_class = classify(short, long)
    assert by_class["neither"] == pytest.approx([0.2])
    assert by_class["long arriving"] == pytest.approx([0.5, 0.1])
    assert by_class["long decoding"] == pytest.approx([2.0, 1.0, 1.5])


def test_gap_classes_give_shares_and_p99_in_ms():
    long = bench_json([10.0], [1.0], [2.0])
    short = bench_json([0.0], [1.0], [20.0], itls=[[0.01] * 9 + [0.05]])  # 1.0-1.1 then 1.1-1.15: all before the burst
    classes = gap_classes(short, long)
    assert [c.name for c in classes] == list(CLASSES)
    neither = classes[2]
    assert neither.count == 10 and neither.share == 1.0
    assert neither.p99_ms == pytest.approx(46.4, abs=0.1)  # numpy's linear p99 of nine 10 ms gaps and one 50 ms gap
    assert classes[0].count == 0 and math.isnan(classes[0].p99_ms)


def test_the_disagg_benchmark_reports_each_class_against_the_rounds_steady_p99():
    from benchmarks.disagg_vs_colocated import Phases, gap_lines

    long = bench_json([10.0], [1.0], [2.0])  # arriving 10-11, decoding 11-12
    short = bench_json([9.0], [0.5], [4.0], itls=[[0.04] * 10 + [0.5, 0.06] + [0.02] * 10])
    rounds = [Phases({**short, "p99_itl_ms": 20.0}, short, long), Phases({**short, "p99_itl_ms": 40.0}, short, long)]
    line, batches = gap_lines({"disaggregated": rounds})
    assert line.startswith("- disaggregated, the bursts phase's short-chat gaps")
    # 9.5-9.9 neither (10 gaps of 40 ms), 9.9-10.66 arriving (12 gaps), none reaches the decode window
    assert "long decoding: 0 / 0 / 0% of gaps, no gaps" in line
    assert "long arriving: 55 / 55 / 55% of gaps" in line and "neither: 45 / 45 / 45% of gaps" in line
    assert "p99 1.00x / 1.50x / 2.00x steady" in line  # neither: 40 ms against 40 and 20 ms steady
    # the same chat in both phases: one chat decoding, 44 gaps pooled over the two rounds in each
    assert batches == ("- disaggregated, gaps by the decode batch they fell in (rounds pooled): median gap with "
                       "bursts / steady at the same number of short chats decoding and no long prompt: 1: 1.00x; "
                       "gaps in batches of 5 or more short chats: 0% steady, 0% with bursts")


def test_gaps_are_grouped_by_the_decode_batch_at_their_midpoint():
    from benchmarks.burst_gaps import by_batch

    # chat A decodes 1.0-2.0, chat B 1.5-2.5; a long prompt decodes 1.8-3.0
    short = bench_json([0.0, 0.0], [1.0, 1.5], [2.0, 2.5], itls=[[0.4, 0.6], [0.4, 0.6]])
    long = bench_json([0.0], [1.8], [3.0])
    groups = by_batch(short, long)
    # A: 1.0-1.4 (mid 1.2: A alone), 1.4-2.0 (mid 1.7: A and B); B: 1.5-1.9 (mid 1.7), 1.9-2.5 (mid 2.2: B and the long)
    assert {key: sorted(v) for key, v in groups.items()} == {
        (1, 0): pytest.approx([0.4]), (2, 0): pytest.approx([0.4, 0.6]), (1, 1): pytest.approx([0.6])}
    assert set(by_batch(short)) == {(1, 0), (2, 0)}  # no long prompts: the last gap is B's alone


def test_batch_summary_compares_equal_batches_and_counts_bunches():
    from benchmarks.burst_gaps import BIG_BATCH, MIN_GAPS, batch_summary

    def chats(n: int, gap: float, count: int, start: float = 0.0) -> dict:
        """n chats decoding together, `count` gaps of `gap` s each."""
        return bench_json([start] * n, [1.0] * n, [1.0 + gap * count] * n, itls=[[gap] * count for _ in range(n)])

    steady = chats(2, 0.010, MIN_GAPS)
    calm_long = bench_json([100.0], [1.0], [2.0])  # decodes long after the chats
    same = chats(2, 0.012, MIN_GAPS)  # the same batch, 1.2x slower
    bunch = chats(BIG_BATCH, 0.030, 4, start=50.0)  # too few gaps to compare, but a bunch
    merged = {key: same[key] + bunch[key] for key in same}
    summary = batch_summary([steady], [(merged, calm_long)])
    assert summary.median_ratios == (pytest.approx((2, 1.2)),)
    assert summary.big_steady == 0.0
    assert summary.big_bursts == pytest.approx(BIG_BATCH * 4 / (2 * MIN_GAPS + BIG_BATCH * 4))
