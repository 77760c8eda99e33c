"""Per-request P/D timelines against `pdserve up --prefill 1 --decode 1` with the real model
and an API key (issue 14 item 2): a request's timeline, fetched by the X-Request-Id it got, has
every phase in order, contiguous from 0 to its end-to-end time; its transfer bytes are the
prefill worker's own pdserve_kv_transfer_bytes counter delta for it; an unknown id is a 404,
no key a 401; `pdserve up --timeline-capacity` reaches the router's ring."""

from __future__ import annotations

import json
import os
import time
from unittest import mock

import httpx
import pytest

from tests.e2e.cluster import metric_sum, start_cluster

pytestmark = pytest.mark.slow
KEY = "sk-timelines-e2e"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAPACITY = 3
PHASES = ["validate", "admission_wait", "reserve", "prefill", "decode", "finish"]
PROMPT = "The history of the printing press begins in the fifteenth century. " * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with mock.patch.dict(os.environ, {"PDSERVE_API_KEY": KEY}):  # never on argv
        c = start_cluster(tmp_path_factory.mktemp("timelines"), "--prefill", "1", "--decode", "1",
                          "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                          "--timeline-capacity", str(CAPACITY))
    try:
        yield c
    finally:
        c.stop()


def _workers(cluster) -> dict[str, dict]:
    view = httpx.get(f"{cluster.base_url}/v1/cluster", headers=AUTH, timeout=10).json()
    return {w["role"]: w for w in view["workers"]}


def _sent_bytes(metrics_address: str) -> float:
    return metric_sum(httpx.get(f"http://{metrics_address}/metrics", timeout=10).text, "pdserve_kv_transfer_bytes_total")


def _stream(cluster, request_id: str, max_tokens: int = 8) -> tuple[list[dict], float, float]:
    """A streamed completion asking for token sample times; (chunks, sent unix, elapsed ms)."""
    sent, start = time.time(), time.monotonic()
    headers = {**AUTH, "X-Request-Id": request_id, "X-Pdserve-Token-Times": "1"}
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    chunks = []
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-request-id"] == request_id
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks, sent, (time.monotonic() - start) * 1000


def _until_changed(read, before: float, timeout_s: float = 10) -> float:
    deadline = time.monotonic() + timeout_s
    while (now := read()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def test_a_requests_timeline_has_every_phase_in_order_adding_up_to_e2e_and_the_workers_transfer_bytes(cluster):
    prefill = _workers(cluster)["prefill"]
    before = _sent_bytes(prefill["metrics_address"])
    chunks, sent, client_ms = _stream(cluster, "tl-first")
    after = _until_changed(lambda: _sent_bytes(prefill["metrics_address"]), before)

    response = httpx.get(f"{cluster.base_url}/v1/requests/tl-first/timeline", headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    t = response.json()
    assert [p["name"] for p in t["phases"]] == PHASES
    assert t["phases"][0]["start_ms"] == 0.0
    for earlier, later in zip(t["phases"], t["phases"][1:]):
        assert later["start_ms"] == earlier["end_ms"]
        assert earlier["duration_ms"] >= 0
    assert t["phases"][-1]["end_ms"] == t["e2e_ms"]
    assert abs(sum(p["duration_ms"] for p in t["phases"]) - t["e2e_ms"]) < 5.0
    assert 0 < t["e2e_ms"] <= client_ms
    assert t["transfer"]["nbytes"] == after - before > 0
    assert t["transfer"]["num_blocks"] > 0 and t["transfer"]["backend"] == "gloo"
    # streamed during the prefill: the wire's share of the open transfer, and its speed over it
    assert 0 < t["transfer"]["wire_seconds"] <= t["transfer"]["seconds"]
    assert t["transfer"]["wire_gbps"] == t["transfer"]["nbytes"] / t["transfer"]["wire_seconds"] / 1e9
    assert (t["path"], t["finish_reason"], t["completion_tokens"]) == ("disaggregated", "length", 8)
    assert (t["route"]["prefill_id"], t["route"]["decode_id"]) == (prefill["worker_id"], _workers(cluster)["decode"]["worker_id"])
    marks = {m["name"]: m["at_ms"] for m in t["marks"]}
    assert marks["first_token"] == t["ttft_ms"] == t["phases"][4]["start_ms"] <= marks["last_token"]
    assert {"worker", "attempts", "worker_queue_ms", "worker_compute_ms"} <= set(t["phases"][3]["detail"])
    # the first token's sample time (the prefill worker's) reached the client with it
    times = [c["pdserve_sampled_at"] for c in chunks if "pdserve_sampled_at" in c]
    assert times and sent <= times[0][0] <= time.time()


def test_an_unknown_request_id_is_404_and_no_key_is_401(cluster):
    unknown = httpx.get(f"{cluster.base_url}/v1/requests/never-sent/timeline", headers=AUTH, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{cluster.base_url}/v1/requests/tl-first/timeline", timeout=10).status_code == 401
    assert httpx.get(f"{cluster.base_url}/v1/requests", timeout=10).status_code == 401


def test_the_ring_holds_timeline_capacity_requests_newest_first(cluster):
    for k in range(CAPACITY + 1):
        _stream(cluster, f"ring-{k}", max_tokens=2)
    listed = httpx.get(f"{cluster.base_url}/v1/requests", params={"limit": 200}, headers=AUTH, timeout=10).json()
    assert [t["request_id"] for t in listed["data"]] == [f"ring-{k}" for k in range(CAPACITY, 0, -1)]
