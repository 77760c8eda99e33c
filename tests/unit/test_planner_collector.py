"""The planner's measurements: rates, busy throughputs, utilisation, queues and p99s from a
window of samples, by differences of the workers' and the router's counters."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router.cluster.keys import WorkerInfo
from router.ops.planner.collector import PlanCollector, RouterTotals, Sample, measure, quantile_ms, router_totals
from router.serving.metrics import RouterMetrics
from router.api.openai_models import CompletionRequest
from tests.unit.roles_doubles import snapshot, worker
from tests.unit.router_doubles import ScriptedBackend, make_service, token_steps


def at(w: WorkerInfo, **counters) -> WorkerInfo:
    return dataclasses.replace(w, **counters)


P0, D0 = worker("prefill-0", "prefill"), worker("decode-0", "decode")


def test_rates_and_busy_throughputs_come_from_the_differences_over_the_window():
    old = Sample(100.0, (at(P0, prompt_tokens=1000, prefill_busy_s=2.0), at(D0, generation_tokens=50, decode_busy_s=1.0,
                                                                              num_running=2)),
                 RouterTotals(requests=10, prompt_tokens=1000, generation_tokens=60, finished_prompt_tokens=900,
                              finished_generation_tokens=50))
    new = Sample(120.0, (at(P0, prompt_tokens=10000, prefill_busy_s=22.0, queued_prefill_tokens=3000),
                         at(D0, generation_tokens=450, decode_busy_s=5.0, num_running=4)),
                 RouterTotals(requests=20, prompt_tokens=10000, generation_tokens=100, finished_prompt_tokens=9900,
                              finished_generation_tokens=90), admission_waiting=1)
    i = measure([old, new], window_s=60, current_prefill=1, current_decode=1)
    assert (i.prompt_tokens_per_s, i.output_tokens_per_s) == (450.0, 2.0)   # 9000 / 20 s, 40 / 20 s
    assert i.mean_request_tokens == 904.0          # finished requests only: (9000 + 40) / 10
    assert (i.prefill_computed_tokens_per_s, i.decode_generated_tokens_per_s) == (450.0, 20.0)
    assert i.prefill_tokens_per_busy_s == 450.0                             # 9000 / 20 busy s
    assert i.decode_tokens_per_busy_s == 100.0                              # 400 / 4 busy s
    assert (i.prefill_utilization, i.decode_utilization) == (1.0, 0.2)
    assert i.queued_prefill_tokens == 3000
    assert i.decode_running == 4.0                                          # mean(2, 4) + 1 waiting
    assert i.decode_batch == 3.0
    assert i.kv_tokens_per_decode_worker == 1600                            # 100 blocks x 16


def test_samples_older_than_the_window_are_not_used():
    samples = [Sample(t, (at(P0, prompt_tokens=p, prefill_busy_s=b),), RouterTotals(prompt_tokens=p))
               for t, p, b in ((0.0, 0, 0.0), (50.0, 100, 1.0), (60.0, 600, 2.0))]
    i = measure(samples, window_s=10, current_prefill=1, current_decode=1)
    assert i.prompt_tokens_per_s == 50.0          # (600 - 100) / 10 s
    assert i.prefill_tokens_per_busy_s == 500.0   # 500 / 1 busy s


def test_an_idle_window_falls_back_to_the_workers_lifetime_throughput():
    busy = at(P0, prompt_tokens=3000, prefill_busy_s=6.0)
    i = measure([Sample(0.0, (busy,), RouterTotals()), Sample(30.0, (busy,), RouterTotals())], 60, 1, 1)
    assert i.prefill_tokens_per_busy_s == 500.0
    assert i.prompt_tokens_per_s == 0.0
    assert i.decode_tokens_per_busy_s is None     # no decode worker ever measured


def test_a_worker_restarted_in_the_window_is_left_out_of_the_differences():
    old = Sample(0.0, (at(P0, prompt_tokens=5000, prefill_busy_s=10.0),), RouterTotals())
    restarted = at(P0, incarnation="inc-2", prompt_tokens=400, prefill_busy_s=1.0)
    i = measure([old, Sample(10.0, (restarted,), RouterTotals())], 60, 1, 1)
    assert i.prefill_tokens_per_busy_s == 400.0   # its new lifetime, not 400 - 5000
    assert i.prefill_utilization == 0.0


def test_p99_is_interpolated_within_its_bucket_from_the_histogram_differences():
    old = ((0.5, 10.0), (1.0, 10.0), (2.5, 10.0), (float("inf"), 10.0))
    new = ((0.5, 10.0), (1.0, 60.0), (2.5, 110.0), (float("inf"), 110.0))
    # 100 new observations: 50 in (0.5, 1], 50 in (1, 2.5]; the 99th is 49/50 into the second bucket
    assert quantile_ms(new, old, 0.99) == pytest.approx(2470.0)
    assert quantile_ms(old, old, 0.99) is None


def test_router_totals_read_the_router_metrics_registry():
    metrics = RouterMetrics("m", 4096)
    for ttft in (0.2, 0.3):
        metrics.count_prompt(100)
        metrics.observe_first_token(ttft)
        metrics.count_generated(7)
        metrics.observe_finished("stop", 100, 7, 1.0, "disaggregated")
    totals = router_totals(metrics.registry)
    assert (totals.requests, totals.prompt_tokens, totals.generation_tokens) == (2.0, 200.0, 14.0)
    assert (totals.finished_prompt_tokens, totals.finished_generation_tokens) == (200.0, 14.0)
    assert dict(totals.ttft_buckets)[0.25] == 1.0 and dict(totals.ttft_buckets)[float("inf")] == 2.0


def test_the_collector_keeps_a_bounded_window_of_samples():
    clock = iter(float(t) for t in range(100))

    async def snap():
        return snapshot(P0, D0)

    collector = PlanCollector(snap, RouterTotals, lambda: 0, window_s=4, interval_s=1, clock=lambda: next(clock))
    async def twenty() -> None:
        for _ in range(20):
            await collector.sample()

    asyncio.run(twenty())
    assert [s.at for s in collector.samples] == [14.0, 15.0, 16.0, 17.0, 18.0, 19.0]
    assert collector.inputs(1, 1).current_prefill == 1


def test_router_token_counters_move_while_a_request_streams_not_only_when_it_ends():
    """The planner's arrival rates read these counters: a long answer counts as it streams."""
    async def scenario():
        backend = ScriptedBackend(token_steps(list(range(1, 11))), hold_after=3)
        service = make_service(backend)
        request = CompletionRequest(model=service.model_card().id, prompt=[5, 6, 7, 8, 9], max_tokens=10)
        stream = await service.stream_complete(request, "r1")

        async def drain() -> None:
            async for _ in stream:
                pass

        reader = asyncio.create_task(drain())
        await asyncio.wait_for(backend.holding.wait(), 5)
        for _ in range(100):  # the run applies the third delta right after the backend yields it
            mid = router_totals(service.metrics.registry)
            if mid.generation_tokens == 3:
                break
            await asyncio.sleep(0.01)
        backend.release.set()
        await asyncio.wait_for(reader, 5)
        await stream.aclose()
        return mid, router_totals(service.metrics.registry)

    mid, end = asyncio.run(scenario())
    assert (mid.requests, mid.prompt_tokens, mid.generation_tokens) == (0.0, 5.0, 3.0)
    assert (end.requests, end.prompt_tokens, end.generation_tokens) == (1.0, 5.0, 10.0)
    assert (end.finished_prompt_tokens, end.finished_generation_tokens) == (5.0, 10.0)
