"""The dashboard sampler over the router's real metrics registry and transfer totals: what
one step appends, that the task samples while started and is gone after stop, and that a
failing read leaves a gap instead of killing it."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from router.cluster.keys import ClusterSnapshot
from router.ops.dashboard.history import History
from router.ops.dashboard.sampler import DashboardSampler, kv_usage, read_metrics
from router.routing.cluster_backend import TransferTotals
from router.serving.metrics import RouterMetrics
from tests.unit.roles_doubles import snapshot, worker


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def backend() -> SimpleNamespace:
    return SimpleNamespace(transfers=TransferTotals(), fallbacks=Counter())


CLUSTER = snapshot(worker("decode-0", "decode", free_blocks=75), worker("decode-1", "decode", free_blocks=25),
                   worker("prefill-0", "prefill", free_blocks=100))


async def fixed() -> ClusterSnapshot:
    return CLUSTER


def served(metrics: RouterMetrics, reason: str, prompt: int, generated: int, e2e_s: float, path: str | None) -> None:
    """What a GenerationRun reports for one backend request from dispatch to its end."""
    metrics.count_prompt(prompt)
    metrics.count_generated(generated)
    metrics.observe_finished(reason, prompt, generated, e2e_s, path)


def test_read_metrics_sums_counters_over_finish_reasons_and_keeps_cumulative_buckets():
    metrics = RouterMetrics("m", 2048)
    served(metrics, "stop", 10, 5, 0.9, "disaggregated")
    served(metrics, "length", 20, 7, 1.2, "colocated")
    metrics.observe_first_token(0.03)
    counters, latency = read_metrics(metrics.registry)
    assert counters == {"finished": 2.0, "prompt_tokens": 30.0, "generation_tokens": 12.0}
    assert dict(latency["ttft"])[0.02] == 0.0 and dict(latency["ttft"])[0.04] == 1.0
    assert dict(latency["e2e"])[1.0] == 1.0 and dict(latency["e2e"])[1.5] == 2.0
    assert latency["itl"] == ()  # no label set observed yet: no samples at all


def test_kv_usage_is_the_used_fraction_of_each_roles_blocks():
    assert kv_usage(CLUSTER) == {"prefill": 0.0, "decode": 0.5}


def test_each_step_appends_the_trailing_window_of_the_real_counters():
    metrics, counts, clock = RouterMetrics("m", 2048), backend(), Clock(100.0)
    history = History(capacity=900)
    sampler = DashboardSampler(history, metrics.registry, counts, fixed, window_s=10.0, clock=clock)
    asyncio.run(sampler.step())
    for _ in range(4):
        served(metrics, "stop", 100, 20, 0.9, "disaggregated")
        metrics.observe_first_token(0.03)
    counts.transfers.add("prefill-0", "decode-0", 4_000_000, 0.002)
    counts.fallbacks["local_prefill"] += 1
    clock.now = 102.0
    asyncio.run(sampler.step())
    body = history.to_json()
    series = body["series"]
    assert body["t"] == [100.0, 102.0]
    assert series["request_rate"] == [None, 2.0]
    assert series["prompt_tokens_per_s"] == [None, 200.0]
    assert series["generation_tokens_per_s"] == [None, 40.0]
    assert series["ttft_p50_ms"] == [None, 30.0]  # (0.02, 0.04] bucket, interpolated
    assert series["kv_usage.decode"] == [50.0, 50.0]
    assert series["transfer_gbps.prefill-0->decode-0"] == [None, 2.0]
    assert series["fallbacks.local_prefill"] == [None, 30.0]  # 1 in 2 s


def test_the_window_drops_readings_older_than_window_s():
    metrics, clock = RouterMetrics("m", 2048), Clock(0.0)
    history = History(capacity=900, interval_s=1.0)
    sampler = DashboardSampler(history, metrics.registry, backend(), fixed, window_s=2.0, clock=clock)
    for t in range(5):
        clock.now = float(t)
        if t == 1:
            metrics.observe_finished("stop", 1, 1, 0.5, None)
        asyncio.run(sampler.step())
    # window of 2 s: the request finished between t=0 and t=1 is out of the window from t=3 on
    assert history.to_json()["series"]["request_rate"] == [None, 1.0, 0.5, 0.0, 0.0]


def test_the_started_sampler_samples_until_stopped_then_its_task_is_gone():
    async def scenario():
        history = History(capacity=900, interval_s=0.01)
        sampler = DashboardSampler(history, RouterMetrics("m", 2048).registry, backend(), fixed)
        sampler.start()
        task = sampler._task
        await asyncio.sleep(0.2)
        await sampler.stop()
        taken = len(history)
        await asyncio.sleep(0.05)
        return taken, len(history), task.done()

    taken, later, done = asyncio.run(scenario())
    assert taken >= 3 and later == taken and done


def test_a_failing_read_leaves_a_gap_and_the_sampler_keeps_going(caplog):
    reads = {"n": 0}

    async def flaky() -> ClusterSnapshot:
        reads["n"] += 1
        if reads["n"] in (2, 3):
            raise ConnectionError("redis down")
        return CLUSTER

    async def scenario():
        history = History(capacity=900, interval_s=0.01)
        sampler = DashboardSampler(history, RouterMetrics("m", 2048).registry, backend(), flaky)
        sampler.start()
        for _ in range(200):
            if len(history) >= 3:
                break
            await asyncio.sleep(0.01)
        await sampler.stop()
        return len(history)

    assert asyncio.run(scenario()) >= 3
    assert [r.message for r in caplog.records].count("dashboard samples skipped until the next good one") == 1


@pytest.mark.parametrize("window_s, interval_s, kept", [(10.0, 1.0, 11), (0.5, 1.0, 2)])
def test_the_window_holds_window_over_interval_plus_one_readings(window_s, interval_s, kept):
    sampler = DashboardSampler(History(interval_s=interval_s), RouterMetrics("m", 2048).registry, backend(), fixed,
                               window_s=window_s)
    assert sampler._window.maxlen == kept
