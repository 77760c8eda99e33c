"""Faults that must hold: a prefill worker killed mid-request is retried on the other one;
a decode worker killed mid-stream ends the client's stream with an error event, not a hang."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e.cluster import start_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("faults"), "--prefill", "2", "--decode", "1",
                      "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                      "--policy", "round_robin")
    try:
        yield c
    finally:
        c.stop()


def _long_prompt(i: int) -> list[int]:
    return [(37 * j + 101 * i) % 30000 + 500 for j in range(900)]


def test_prefill_worker_killed_mid_request_is_retried_on_the_other(cluster):
    async def one(client, i):
        return await client.post("/v1/completions", json={
            "model": "SmolLM2-135M-Instruct", "prompt": _long_prompt(i), "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(6)]
            await asyncio.sleep(1.5)  # round robin: prefill-0 holds requests 0, 2 and 4
            os.kill(cluster.worker_pid("prefill-0"), signal.SIGKILL)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    assert all(len(r.json()["choices"][0]["text"]) > 0 or r.json()["usage"]["completion_tokens"] == 4
               for r in responses)
    retries = re.findall(r"^pdserve_prefill_retries_total\S* (\S+)$", cluster.metrics(), re.M)
    assert retries and float(retries[0]) >= 1


def test_decode_worker_killed_mid_stream_ends_the_stream_with_an_error_event(cluster):
    events: list[str] = []
    started = time.monotonic()
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 1000,
                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(cluster.worker_pid("decode-0"), signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "error" in error, events[-2]
    assert len(events) < 1000
    assert time.monotonic() - started < 60
