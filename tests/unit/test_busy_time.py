"""An engine step's time is charged to prefill and decode by the tokens it computed, so a
worker's tokens per busy second is its throughput while working (the planner's measure)."""

from __future__ import annotations

import pytest

from engine.core import charge_busy_time
from engine.scheduler_types import SchedulerStats


def test_a_prefill_only_step_is_all_prefill_time():
    stats = SchedulerStats()
    charge_busy_time(stats, 0.5, prompt_tokens=256, generated=0)
    assert (stats.prefill_busy_s, stats.decode_busy_s) == (0.5, 0.0)


def test_a_mixed_step_is_split_by_its_tokens():
    stats = SchedulerStats()
    charge_busy_time(stats, 1.0, prompt_tokens=60, generated=4)
    assert stats.prefill_busy_s == pytest.approx(0.9375)
    assert stats.decode_busy_s == pytest.approx(0.0625)


def test_a_step_that_computed_nothing_charges_nothing():
    stats = SchedulerStats()
    charge_busy_time(stats, 0.2, prompt_tokens=0, generated=0)
    assert (stats.prefill_busy_s, stats.decode_busy_s) == (0.0, 0.0)
