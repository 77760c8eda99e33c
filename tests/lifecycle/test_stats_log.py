"""A worker's stats line, from the real PrefillWorker and DecodeWorker (tiny model, `local`
transfers) after one known request: its exact text, and a line only when it changed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from tests.lifecycle.pd_pair import assert_idle, make_pair, prompt
from worker_runtime.stats_log import WorkerStatsLog

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = prompt(40)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair(tiny_model_dir):
    p = make_pair(tiny_model_dir, max_num_batched_tokens=32)
    yield p
    p.stop()


async def _one_request(pair) -> None:
    ticket, outputs = await pair.decode.admit("r", PROMPT, PARAMS, 60.0)
    await asyncio.wait_for(pair.prefill.prefill("r", PROMPT, PARAMS, pair.target(ticket)), 30)
    while True:
        item = await asyncio.wait_for(outputs.get(), 30)
        if item.finish_reason is not None:
            return


def test_stats_lines_after_one_request_give_its_exact_rates_then_one_idle_line(pair, caplog):
    clock = Clock()
    logs = {role: WorkerStatsLog(worker.status, 10.0, clock)
            for role, worker in (("prefill", pair.prefill), ("decode", pair.decode))}
    asyncio.run(_one_request(pair))
    assert_idle(pair.prefill)
    assert_idle(pair.decode)
    for worker in (pair.prefill, pair.decode):  # status() is the loop's last refresh: let it catch up
        assert wait_until(lambda: worker.status().core == worker.loop.submit(worker.core.stats).result(10), 10)
    nbytes = pair.prefill.status().transfers.nbytes
    assert nbytes == pair.decode.status().transfers.nbytes > 0
    clock.now += 10.0
    with caplog.at_level(logging.INFO, logger="worker_runtime.stats_log"):
        lines = {role: log.tick() for role, log in logs.items()}
    gb_per_s = f"{nbytes / 1e9 / 10:.3f}"
    # prefill: 40 prompt tokens computed (two chunks of the 32-token budget), 1 token sampled;
    # decode: the KV arrived (no prompt computed), 4 more tokens sampled; each looked the
    # 40-token prompt up in its empty prefix cache (0 hits); one transfer each side.
    assert lines == {
        "prefill": "Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 0.1 tokens/s, Running: 0 reqs, "
                   "Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%, "
                   f"KV transfers: 0.1/s, {gb_per_s} GB/s",
        "decode": "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.4 tokens/s, Running: 0 reqs, "
                  "Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%, "
                  f"KV transfers: 0.1/s, {gb_per_s} GB/s",
    }
    assert [r.getMessage() for r in caplog.records] == [lines["prefill"], lines["decode"]]
    assert caplog.records[0].stats["prompt_throughput"] == 4.0
    idle = ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
            "Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%, KV transfers: 0.0/s, 0.000 GB/s")
    clock.now += 10.0
    assert [log.tick() for log in logs.values()] == [idle, idle]  # the rates changed (to 0): one line
    clock.now += 10.0
    assert [log.tick() for log in logs.values()] == [None, None]  # nothing changed: no line


def test_an_idle_worker_logs_no_stats_line(pair):
    clock = Clock()
    log = WorkerStatsLog(pair.decode.status, 10.0, clock)
    for _ in range(3):
        clock.now += 10.0
        assert log.tick() is None
