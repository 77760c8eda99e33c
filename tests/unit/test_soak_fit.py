from benchmarks.soak import Sample, memory_rows, slope_mb_per_min


def test_slope_is_megabytes_per_minute_of_a_least_squares_fit():
    assert slope_mb_per_min([(0.0, 100.0), (60.0, 102.0), (120.0, 104.0)]) == 2.0
    assert slope_mb_per_min([(0.0, 5.0), (30.0, 5.0), (90.0, 5.0)]) == 0.0
    assert slope_mb_per_min([(0.0, 1.0), (60.0, 2.0)]) != slope_mb_per_min([(0.0, 1.0), (60.0, 2.0)])  # nan


def test_memory_rows_fit_only_after_warmup_and_split_the_rest_in_halves():
    # 10 MB/min for the first 2 minutes (warm-up), then 4 MB/min, then flat.
    points = [(0, 100), (60, 110), (120, 120), (180, 124), (240, 128), (300, 128), (360, 128), (420, 128)]
    samples = [Sample(t, "prefill:prefill-0", 7, mb, mb - 50, None, None) for t, mb in points]
    [row] = memory_rows(samples, warmup_s=110)
    assert row[0] == "prefill:prefill-0"
    assert row[1:4] == ["100.0", "128.0", "128.0"]
    assert row[5:7] == ["4.00", "0.00"]  # first half still growing, second half levelled off
    assert row[7] == row[4]  # RssAnon: the same growth here
    assert row[-1] == "NOT MET"
