"""The paths benchmarks/router_overhead.py times: a router's (pdserve bench's client against its
HTTP port), and pdserve's direct one (the router's own calls to the doubles, made from the
benchmark's process over the worker link or gRPC), with what one run of a path measured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from benchmarks.router_peers import Started
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.runner import RunSettings, run_benchmark
from proto.auth import load_cluster_secret
from proto.internal_auth import internal_channel
from proto.link import LinkChannel, LinkDecodeStub, LinkPrefillStub
from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["PathRun", "direct_call", "direct_path", "merged", "router_path"]


@dataclass(frozen=True)
class PathRun:
    """One path at one concurrency."""

    latencies_s: list[float]
    failed: int
    seconds: float
    client_cpu_s: float
    router_cpu_s: float
    doubles_cpu_s: float = 0.0
    """CPU seconds of the doubles the path called (router paths only; 0 where not measured)."""

    @property
    def req_per_s(self) -> float:
        return len(self.latencies_s) / self.seconds

    def percentile_ms(self, p: float) -> float:
        return float(np.percentile(self.latencies_s, p)) * 1e3 if self.latencies_s else float("nan")


def merged(runs: list[PathRun]) -> PathRun:
    """Rounds of one path as one run: every latency, and the totals (req/s over all rounds)."""
    return PathRun([x for r in runs for x in r.latencies_s], sum(r.failed for r in runs),
                   sum(r.seconds for r in runs), sum(r.client_cpu_s for r in runs),
                   sum(r.router_cpu_s for r in runs), sum(r.doubles_cpu_s for r in runs))


async def router_path(router: Started, requests: list[SampleRequest], concurrency: int,
                      doubles_cpu_s: Callable[[], float] | None = None) -> PathRun:
    """doubles_cpu_s: the CPU seconds so far of the doubles this router calls (measured around
    the run as the router's own are)."""
    settings = RunSettings(router.endpoint, max_concurrency=concurrency, progress=False)
    cpu0, doubles0 = router.cpu_s(), doubles_cpu_s() if doubles_cpu_s else 0.0
    run = await run_benchmark(settings, requests)
    ok = [o.latency for o in run.outputs if o.success]
    return PathRun(ok, len(run.outputs) - len(ok), run.duration_s, run.cpu_s, router.cpu_s() - cpu0,
                   doubles_cpu_s() - doubles0 if doubles_cpu_s else 0.0)


async def direct_call(prefill, decode, request_id: str, prompt_ids: list[int], max_tokens: int) -> float:
    """The router's calls for one request, made straight to the doubles; returns seconds."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    stream = decode.Decode(worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                                    sampling=sampling, ticket_timeout_ms=60_000))
    first = await stream.read()
    await prefill.Prefill(worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                                    sampling=sampling, ticket=first.ticket))
    while (event := await stream.read()) is not grpc.aio.EOF:
        if event.tokens.finish_reason:
            break
    return time.perf_counter() - start


async def direct_path(addresses: tuple[str, str], prompts: list[list[int]], max_tokens: int, concurrency: int,
                      tag: str, link: bool = False) -> PathRun:
    """The router's calls made from here over gRPC, or over the worker link (`link`)."""
    secret = load_cluster_secret()  # what the router proves too: the comparison stays fair
    channel = LinkChannel if link else internal_channel
    async with channel(addresses[0], secret) as p_chan, channel(addresses[1], secret) as d_chan:
        if link:
            prefill, decode = LinkPrefillStub(p_chan), LinkDecodeStub(d_chan)
        else:
            prefill, decode = worker_pb2_grpc.PrefillWorkerStub(p_chan), worker_pb2_grpc.DecodeWorkerStub(d_chan)
        queue = list(enumerate(prompts))
        latencies: list[float] = []
        failed = 0

        async def worker() -> None:
            nonlocal failed
            while queue:
                i, ids = queue.pop(0)
                try:
                    latencies.append(await direct_call(prefill, decode, f"{tag}-{i}", ids, max_tokens))
                except grpc.aio.AioRpcError:  # a link call's error is one too
                    failed += 1

        cpu0, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return PathRun(latencies, failed, time.perf_counter() - start, time.process_time() - cpu0, 0.0)
