"""`pdserve up` (1 prefill + 1 decode, real model) under the faults of issue 10, items 1 and 6:

- a storm of clients that give up during prefill never leaves an ordinary request hanging,
  and leaves no KV block held on any worker;
- a request whose internal message gRPC refuses (a huge stop list) gets an immediate 4xx and
  never holds the admission queue in front of ordinary requests;
- a SIGSTOPped decode worker ends each open stream within about --stream-idle-timeout with an
  explicit error event, and the cluster serves again after SIGCONT with no block held.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time

import httpx
import pytest

from tests.e2e.cluster import start_cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
IDLE_TIMEOUT_S = 5.0
STORM_S = 40.0
LEAVERS = 12
ORDINARY = 6
ORDINARY_TOKENS = 12
CLIENT_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("storm"), "--prefill", "1", "--decode", "1",
                      "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "128MiB",
                      "--stream-idle-timeout", str(IDLE_TIMEOUT_S))
    try:
        yield c
    finally:
        c.stop()


def _long_prompt(rng: random.Random) -> list[int]:
    """A prompt no other request shares (no prefix-cache hit), long enough to be in prefill
    for a while on a CPU."""
    return [rng.randrange(500, 30000) for _ in range(rng.randrange(400, 800))]


def _body(prompt, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[int, list[str]]:
    """Status and every SSE data payload of one streaming request."""
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.text]
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return 200, events


def _completion_tokens(events: list[str]) -> int | None:
    for event in reversed(events):
        if event != "[DONE]" and json.loads(event).get("usage"):
            return json.loads(event)["usage"]["completion_tokens"]
    return None


def _pool_state(cluster) -> dict[str, tuple[int, int, int, int]]:
    """worker id -> (free, total, reserved, running + waiting) from each worker's /metrics."""
    state = {}
    for worker_id in cluster.workers:
        text = cluster.metrics(worker_id)

        def value(name: str) -> int:
            found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            return int(float(found[0]))

        state[worker_id] = (value("pdserve_kv_blocks_free"), value("pdserve_kv_blocks_total"),
                            value("pdserve_kv_blocks_reserved"),
                            value("vllm:num_requests_running") + value("vllm:num_requests_waiting"))
    return state


def _assert_pools_empty(cluster, within_s: float = 30.0) -> None:
    """Every worker's pool drains within `within_s` (well below the 60 s ticket deadline, so a
    reservation nobody aborted is caught, not expired)."""
    start, history = time.monotonic(), []
    while True:
        state = _pool_state(cluster)
        if all(free == total and reserved == 0 and busy == 0 for free, total, reserved, busy in state.values()):
            return
        history.append((round(time.monotonic() - start, 1), state))
        assert time.monotonic() - start < within_s, f"blocks still held: {history[::10] + history[-1:]}"
        time.sleep(0.5)


async def _leaver(client: httpx.AsyncClient, rng: random.Random, until: float) -> int:
    """Sends long streaming prompts and gives up on each after 0.2-1.5 s; returns how many."""
    sent = 0
    while time.monotonic() < until:
        sent += 1
        try:
            await asyncio.wait_for(_stream(client, _body(_long_prompt(rng), 64)), rng.uniform(0.2, 1.5))
        except asyncio.TimeoutError:
            pass
    return sent


async def _ordinary(client: httpx.AsyncClient, k: int, until: float) -> list[tuple[int, str, int | None, float]]:
    """Back-to-back ordinary streams: (status, last event, completion tokens, seconds) each."""
    results = []
    while time.monotonic() < until:
        start = time.monotonic()
        try:
            status, events = await asyncio.wait_for(
                _stream(client, _body(f"Request {len(results)} of client {k}: tell me a story.", ORDINARY_TOKENS)),
                CLIENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            results.append((0, "client timeout", None, time.monotonic() - start))
            continue
        results.append((status, events[-1] if events else "", _completion_tokens(events), time.monotonic() - start))
    return results


def test_ordinary_streams_complete_while_clients_disconnect_during_prefill(cluster):
    async def storm():
        limits = httpx.Limits(max_connections=LEAVERS + ORDINARY + 4)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
            until = time.monotonic() + STORM_S
            leavers = [_leaver(client, random.Random(i), until) for i in range(LEAVERS)]
            ordinary = [_ordinary(client, k, until) for k in range(ORDINARY)]
            done = await asyncio.gather(*leavers, *ordinary)
        return sum(done[:LEAVERS]), [r for client_results in done[LEAVERS:] for r in client_results]

    left, results = asyncio.run(storm())
    assert left >= LEAVERS * 2
    bad = [r for r in results if r[:3] != (200, "[DONE]", ORDINARY_TOKENS)]
    assert not bad, f"{len(bad)} of {len(results)} ordinary requests failed: {bad[:5]}"
    assert len(results) >= ORDINARY
    _assert_pools_empty(cluster)


def test_a_request_too_large_for_internal_messages_is_refused_at_once_without_delaying_others(cluster):
    huge_stop = [f"{i:05d}" + "x" * 995 for i in range(4800)]  # 4.8 MB: above gRPC's 4 MiB default

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S) as client:
            start = time.monotonic()
            big = asyncio.create_task(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 8, "stop": huge_stop}))
            await asyncio.sleep(0.5)
            ordinary = [asyncio.create_task(_stream(client, _body(f"Say hi {k}", 8))) for k in range(3)]
            big_response = await big
            big_s = time.monotonic() - start
            streams = await asyncio.gather(*ordinary)
            return big_response, big_s, streams, time.monotonic() - start

    big, big_s, streams, all_s = asyncio.run(scenario())
    assert big.status_code in (400, 413), big.text
    assert set(big.json()["error"]) == {"message", "type", "param", "code"}
    assert big.json()["error"]["code"] == big.status_code
    assert big_s < 15.0
    assert [(status, events[-1], _completion_tokens(events)) for status, events in streams] == [(200, "[DONE]", 8)] * 3
    assert all_s < 25.0  # main: they waited ~30 s behind it in the admission queue


def test_a_stopped_decode_worker_ends_open_streams_with_an_error_then_recovers(cluster):
    decode_pid = cluster.worker_pid("decode-0")

    async def open_streams():
        ended: list[tuple[float, list[str]]] = []
        stopped_at: list[float] = []
        received = asyncio.Event()
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S) as client:
            async def one(k: int):
                events: list[str] = []
                async with client.stream("POST", "/v1/completions",
                                         json=_body(f"Story {k}: once upon a time", 1500)) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) >= 3:
                                received.set()
                ended.append((time.monotonic(), events))

            tasks = [asyncio.create_task(one(k)) for k in range(4)]
            await asyncio.wait_for(received.wait(), 60)
            await asyncio.sleep(1.0)
            os.kill(decode_pid, signal.SIGSTOP)
            stopped_at.append(time.monotonic())
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), IDLE_TIMEOUT_S + 25)
            finally:
                os.kill(decode_pid, signal.SIGCONT)
        return stopped_at[0], ended

    try:
        stopped_at, ended = asyncio.run(open_streams())
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    assert len(ended) == 4
    for end, events in ended:
        assert events[-1] == "[DONE]"
        error = next(json.loads(e) for e in reversed(events) if e != "[DONE]" and "error" in json.loads(e))
        assert "sent nothing for 5 s" in error["error"]["message"]
        assert end - stopped_at < IDLE_TIMEOUT_S + 15
    _assert_serves_again(cluster)
    _assert_pools_empty(cluster, within_s=30.0)


def _assert_serves_again(cluster) -> None:
    """A canary succeeds within 60 s of SIGCONT (the decode worker's heartbeat comes back)."""
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=cluster.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        while True:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True})
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 4
                return
            assert time.monotonic() < deadline, r.text
            time.sleep(1.0)
