"""Sending a run's requests on schedule and collecting their outputs.

Requests go out at their arrival offsets (pdserve.bench.arrivals); at most max_concurrency
are in flight (the rest wait their turn, as in vLLM); every output is collected, failed or
not. One pooled aiohttp session (pdserve.bench.client.open_session) carries them all.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import Endpoint, RequestOutput, open_session, send_request
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.progress import ProgressBar
from proto.heap import settle_heap


@dataclass(frozen=True)
class RunSettings:
    endpoint: Endpoint
    request_rate: float = math.inf
    """Requests per second; inf sends all at once."""
    burstiness: float = 1.0
    """Shape of the gamma-distributed gaps; 1 is Poisson."""
    max_concurrency: int | None = None
    """Most requests in flight at once; None: no limit."""
    seed: int = 0
    num_warmups: int = 0
    """Requests (the first prompt, repeated) sent and discarded before the timed run."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1; got {self.max_concurrency}")


@dataclass(frozen=True)
class RunResult:
    outputs: list[RequestOutput]
    """In the order of the requests."""
    duration_s: float
    """From the first send to the last response."""
    cpu_s: float
    """CPU time this process used during the run (every thread)."""

    @property
    def cpu_percent(self) -> float:
        """The client's CPU use over the run, in % of one core (100 = one core busy)."""
        return 100.0 * self.cpu_s / self.duration_s if self.duration_s > 0 else 0.0


async def run_benchmark(settings: RunSettings, requests: list[SampleRequest]) -> RunResult:
    """Send every request (after the warm-ups) and wait for all. Never raises for a failed
    request; raises ValueError for bad settings."""
    offsets = arrival_offsets(len(requests), settings.request_rate, settings.burstiness, settings.seed)
    async with open_session(settings.max_concurrency) as client:
        if settings.num_warmups:
            await asyncio.gather(*(send_request(client, settings.endpoint, requests[0])
                                   for _ in range(settings.num_warmups)))
        # The client's own full collections (its tokenizer alone is ~300,000 tracked objects:
        # ~100 ms a collection) would be timed as the server's latency: freeze what is built.
        settle_heap()
        return await _timed_run(client, settings, requests, offsets)


async def _timed_run(client: aiohttp.ClientSession, settings: RunSettings, requests: list[SampleRequest],
                     offsets: list[float]) -> RunResult:
    semaphore = asyncio.Semaphore(settings.max_concurrency or len(requests))
    bar = ProgressBar(len(requests), settings.progress)

    async def one(request: SampleRequest) -> RequestOutput:
        async with semaphore:
            output = await send_request(client, settings.endpoint, request)
        bar.update(output.success)
        return output

    cpu0, start = time.process_time(), time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    outputs = list(await asyncio.gather(*tasks))
    return RunResult(outputs, time.perf_counter() - start, time.process_time() - cpu0)
