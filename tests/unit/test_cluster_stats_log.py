"""The router's cluster stats line: sums over the snapshot's heartbeats, rates over the
interval, robust to a worker restarting (its counters start again from 0)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.serving.stats_log import ClusterStats, StatsTicker, run_cluster_stats


def worker(worker_id: str, role: str, incarnation: str = "i1", **values) -> WorkerInfo:
    base = dict(worker_id=worker_id, role=role, address="127.0.0.1:1", metrics_address="", incarnation=incarnation,
                block_size=16, total_blocks=100, free_blocks=100, reserved_blocks=0, cached_blocks=0, num_running=0,
                num_waiting=0, queued_prefill_tokens=0, max_model_len=2048, updated_at=0.0)
    return WorkerInfo(**{**base, **values})


def snapshot(*workers: WorkerInfo) -> ClusterSnapshot:
    return ClusterSnapshot(workers=tuple(workers), taken_at=0.0, stale=False)


P0 = worker("prefill-0", "prefill", prompt_tokens=1000, generation_tokens=10, prefix_cache_queries=1000,
            prefix_cache_hits=200)
D0 = worker("decode-0", "decode", generation_tokens=500, prefix_cache_queries=1000, prefix_cache_hits=0)


def test_the_cluster_line_sums_the_workers_over_the_interval():
    stats = ClusterStats()
    ticker = StatsTicker(stats.sample(snapshot(P0, D0), 3, 3_000_000_000, 0, now=100.0))
    later = snapshot(
        dataclasses.replace(P0, prompt_tokens=1400, generation_tokens=14, prefix_cache_queries=1400,
                            prefix_cache_hits=300, free_blocks=90, num_waiting=1),
        dataclasses.replace(D0, generation_tokens=716, prefix_cache_queries=1400, prefix_cache_hits=0,
                            free_blocks=50, num_running=4))
    text, fields = ticker.tick(stats.sample(later, 7, 5_000_000_000, 2, now=110.0))
    # prompt 400/10 s; generation (4 + 216)/10 s; hits 100 of 800 queries; 4 transfers, 2 GB
    assert text == ("Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 22.0 tokens/s, "
                    "Running: 4 reqs, Waiting: 3 reqs, KV cache usage: prefill 10.0%, decode 50.0%, "
                    "Prefix cache hit rate: 12.5%, KV transfers: 0.4/s, 0.200 GB/s")
    assert fields["kv_cache_usage"] == {"prefill": 10.0, "decode": 50.0}
    assert ticker.tick(stats.sample(later, 7, 5_000_000_000, 2, now=120.0))[0].startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 4 reqs")
    assert ticker.tick(stats.sample(later, 7, 5_000_000_000, 2, now=130.0)) is None


def test_a_restarted_worker_counts_from_zero_and_a_new_one_from_its_next_heartbeat():
    stats = ClusterStats()
    first = stats.sample(snapshot(P0), 0, 0, 0, now=0.0)
    restarted = dataclasses.replace(P0, incarnation="i2", prompt_tokens=64, generation_tokens=1,
                                    prefix_cache_queries=64, prefix_cache_hits=0)
    joined = worker("prefill-1", "prefill", prompt_tokens=5000)
    second = stats.sample(snapshot(restarted, joined), 0, 0, 0, now=10.0)
    assert (second.prompt_tokens - first.prompt_tokens, second.generation_tokens - first.generation_tokens) == (64, 1)
    third = stats.sample(snapshot(restarted, dataclasses.replace(joined, prompt_tokens=5100)), 0, 0, 0, now=20.0)
    assert third.prompt_tokens - second.prompt_tokens == 100


def test_the_router_task_logs_a_cluster_line_when_the_cluster_worked(caplog):
    from types import SimpleNamespace

    snapshots = iter([snapshot(P0, D0), snapshot(dataclasses.replace(P0, prompt_tokens=1100), D0)])
    backend = SimpleNamespace(transfers=SimpleNamespace(count=0, nbytes=0), admission=SimpleNamespace(num_waiting=0))
    times = iter([0.0, 10.0])

    async def next_snapshot():
        return next(snapshots)

    async def main():
        task = asyncio.create_task(run_cluster_stats(next_snapshot, backend, 0.01, clock=lambda: next(times)))
        for _ in range(500):
            if caplog.records:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="router.serving.stats_log"):
        asyncio.run(main())
    assert [r.getMessage()[:52] for r in caplog.records] == ["Cluster: Avg prompt throughput: 10.0 tokens/s, Avg g"]
