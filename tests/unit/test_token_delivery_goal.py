"""benchmarks/token_delivery.py's goal line says how many runs met the 5 ms goal, not only
whether all did."""

from __future__ import annotations

from benchmarks.token_delivery import goal_line


def test_the_goal_line_counts_the_runs_that_met_it():
    assert goal_line("int8", [5.40, 4.23]) == (
        "int8: token delivery p99 4.23-5.40 ms over 2 run(s) (met in 1 of 2 runs: goal <= 5 ms)")
    assert goal_line("link", [4.14, 4.99]).endswith("(met in every run: goal <= 5 ms)")
    assert goal_line("link", [5.01, 7.0]).endswith("(NOT MET in any run: goal <= 5 ms)")
