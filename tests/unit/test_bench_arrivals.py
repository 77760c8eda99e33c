"""pdserve bench's send schedule: vLLM's gamma/Poisson arrivals, exact for a seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets


def test_poisson_arrivals_for_seed_0_are_exact_and_end_at_n_over_rate():
    assert arrival_offsets(5, 2.0, 1.0, seed=0) == [
        0.4612933000308972, 1.189237769060302, 1.724343049132401, 2.180609223781806, 2.5]


def test_arrivals_equal_vllms_global_numpy_stream_for_the_same_seed():
    saved = np.random.get_state()
    np.random.seed(7)  # what `vllm bench serve --seed 7` does before drawing its gaps
    gaps = np.cumsum([np.random.gamma(shape=0.5, scale=1 / (4.0 * 0.5)) for _ in range(4)])
    np.random.set_state(saved)
    factor = (4 / 4.0) / gaps[-1]
    want = [float(g * factor) for g in gaps]
    assert arrival_offsets(4, 4.0, 0.5, seed=7) == want
    assert arrival_offsets(4, 4.0, 0.5, seed=7) == [
        0.007358857940979172, 0.25025821430346595, 0.3413246090428112, 1.0]


def test_infinite_rate_sends_every_request_at_time_zero():
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]


def test_infinite_burstiness_spaces_requests_evenly():
    assert arrival_offsets(3, 1.0, math.inf, seed=0) == [1.0, 2.0, 3.0]


def test_same_seed_same_schedule_and_offsets_never_decrease():
    a = arrival_offsets(50, 10.0, 0.3, seed=3)
    assert a == arrival_offsets(50, 10.0, 0.3, seed=3)
    assert a != arrival_offsets(50, 10.0, 0.3, seed=4)
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] == pytest.approx(5.0)


@pytest.mark.parametrize("n, rate, burstiness", [(0, 1.0, 1.0), (2, 0.0, 1.0), (2, 1.0, 0.0), (2, -1.0, 1.0)])
def test_invalid_schedule_settings_raise(n, rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(n, rate, burstiness, seed=0)
