"""When each request is sent: offsets from the start of the run, in seconds.

Same process as `vllm bench serve`: gaps drawn from a gamma distribution with shape
`burstiness` and mean 1/rate (burstiness 1 is a Poisson process), summed, then scaled so the
last request goes out at exactly num_requests / rate; rate inf sends everything at time 0.
The gaps come from numpy's legacy RandomState(seed), which is the stream vLLM draws them from
after `np.random.seed(seed)`, so one seed gives the same schedule in both tools.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, seconds after the first, non-decreasing. Pure (own rng)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1; got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf); got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0; got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):  # gamma with infinite shape: constant gaps
        gaps = [1.0 / request_rate] * num_requests
    else:
        rng = np.random.RandomState(seed)
        scale = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
        gaps = [float(rng.gamma(shape=burstiness, scale=scale)) for _ in range(num_requests)]
    offsets = list(np.cumsum(gaps))
    # Scale so the total matches the configured rate exactly: the raw sum is a few % off,
    # and that noise would otherwise show up as throughput differences between seeds.
    factor = (num_requests / request_rate) / offsets[-1]
    return [float(o * factor) for o in offsets]
