"""Issue 14 item 3's acceptance: the profile-free planner on `pdserve up --prefill 1 --decode 1`
with the real model, from live measurements only.

One cluster for the module, with --autoscale (bounded to 2 per role, so at most one extra
worker of each role starts on this small machine). In order: long prompts with short outputs
overwhelm the one prefill worker -> GET /v1/plan recommends more prefill and not more decode,
and the autoscaler raises prefill's desired count through the scaler; then short prompts with
long outputs -> more decode and not more prefill, and decode's desired count rises;
`pdserve plan --live URL` prints the recommendation. Conditions are polled (bounded): the
rates are over a window that must first fill with the phase's traffic.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.cluster import ROOT, RunningCluster, start_cluster
from tests.e2e.load import stream_completion

pytestmark = pytest.mark.slow

WINDOW_S = 20
PHASE_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("planner"), "--prefill", "1", "--decode", "1",
                      "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                      "--max-replicas", "2", "--prefill-timeout", "120", "--stream-idle-timeout", "120", "--plan-window", str(WINDOW_S), "--plan-target-utilization", "0.6",
                      "--slo-ttft-ms", "3000", "--autoscale", "--autoscale-interval", "2",
                      "--autoscale-cooldown", "10", "--autoscale-max-prefill", "2", "--autoscale-max-decode", "2")
    try:
        yield c
    finally:
        c.stop()


class Load:
    """`concurrency` clients sending streamed completions back to back on a thread, until stop()."""

    def __init__(self, base_url: str, concurrency: int, prompt_len: int, max_tokens: int, seed: int) -> None:
        self._args = (base_url, concurrency, prompt_len, max_tokens)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self.statuses: list[int] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def _prompt(self, length: int) -> list[int]:
        # Random ids from the first token on: no prompt shares a cached prefix with another.
        return [self._rng.randrange(1000, 40000) for _ in range(length)]

    async def _client(self, client: httpx.AsyncClient) -> None:
        _, _, prompt_len, max_tokens = self._args
        while not self._stop.is_set():
            result = await stream_completion(client, self._prompt(prompt_len), max_tokens)
            self.statuses.append(result.status)

    async def _run(self) -> None:
        base_url, concurrency = self._args[:2]
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            await asyncio.gather(*(self._client(client) for _ in range(concurrency)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=150)
        assert not self._thread.is_alive(), "load clients did not finish"


def plan(cluster: RunningCluster) -> dict:
    r = httpx.get(f"{cluster.base_url}/v1/plan", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for_plan(cluster: RunningCluster, predicate) -> dict:
    """Poll GET /v1/plan until predicate(body) (bounded); the last body either way."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while True:
        body = plan(cluster)
        if predicate(body) or time.monotonic() > deadline:
            return body
        time.sleep(1)


def wait_for_desired(cluster: RunningCluster, role: str, count: int, timeout_s: float = 30) -> int | None:
    deadline = time.monotonic() + timeout_s
    while True:
        desired = cluster.roles()[role]["desired"]
        if desired == count or time.monotonic() > deadline:
            return desired
        time.sleep(0.5)


def test_long_prompts_recommend_more_prefill_not_more_decode_and_autoscale_raises_prefill(cluster):
    load = Load(cluster.base_url, concurrency=3, prompt_len=400, max_tokens=2, seed=1)
    try:
        body = wait_for_plan(cluster, lambda b: b["recommended"] == {"prefill": 2, "decode": 1}
                             and b["inputs"]["prompt_tokens_per_s"] > 0)  # measured, not only the backlog
        desired = wait_for_desired(cluster, "prefill", 2)
    finally:
        load.stop()
    assert body["recommended"] == {"prefill": 2, "decode": 1}, body
    assert body["inputs"]["prompt_tokens_per_s"] > 0 and body["inputs"]["prefill_tokens_per_busy_s"] > 0, body
    print("\n".join(body["arithmetic"]))
    assert desired == 2, cluster.roles()
    assert body["autoscale"]["enabled"] is True
    assert set(load.statuses) == {200}


def test_long_outputs_recommend_more_decode_not_more_prefill_and_autoscale_raises_decode(cluster):
    load = Load(cluster.base_url, concurrency=6, prompt_len=8, max_tokens=32, seed=2)
    try:
        body = wait_for_plan(cluster, lambda b: b["recommended"] == {"prefill": 1, "decode": 2})
        desired = wait_for_desired(cluster, "decode", 2)
        live = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--live", cluster.base_url], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env={**os.environ})
    finally:
        load.stop()
    assert body["recommended"] == {"prefill": 1, "decode": 2}, body
    print("\n".join(body["arithmetic"]))
    assert desired == 2, cluster.roles()
    assert live.returncode == 0, live.stderr
    lines = live.stdout.splitlines()
    assert lines[0] == f"live plan over the last {WINDOW_S} s (SLO: TTFT p99 3000 ms, ITL p99 -)"
    assert lines[2].split()[:1] == ["prefill"] and lines[3].split()[:1] == ["decode"]
    assert "arithmetic:" in lines and lines[-1].startswith("autoscale: on (prefill 1..2, decode 1..2); last action: ")
    assert set(load.statuses) == {200}
