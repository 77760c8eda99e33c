"""Issue 12's acceptance: `pdserve up --launcher ray --prefill 1 --decode 1` on a real local Ray
instance, with the real model: the same cluster as with local processes, placed by Ray.

One cluster for the module; the tests run in order, each first bringing the cluster to the
shape it needs: 30 concurrent greedy requests (tokens equal the offline engine's, one actor per
component in Ray's state API) -> scaled to 2+2 and back to 1+1 through `pdserve scale` while
streams run -> a decode actor killed through Ray under load and replaced -> Ctrl-C, after which
no actor, no Ray or worker process and no port is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.cluster import RunningCluster, start_cluster
from tests.e2e.load import (Reference, assert_pools_empty, complete_all, ensure_shape, fresh_prompts,
                            offline_reference, stream_completion, streams_through_a_kill, wait_for_restart,
                            worker_ids)
from tests.real_model import prompt_token_ids

pytest.importorskip("ray", reason="the Ray launcher needs pdserve[ray] (the test extras include it)")
pytestmark = pytest.mark.slow

SHORT, LONG, KILLED = 16, 48, 400
NAMESPACE = "pdserve-default"
RAY_PROCESSES = ("gcs_server", "raylet", "ray::")
"""What a local Ray instance runs (its dashboard and agents are ray:: processes too)."""


@pytest.fixture(scope="module")
def reference() -> Reference:
    return offline_reference(SHORT, LONG)


@pytest.fixture(scope="module")
def ray_cluster(reference, tmp_path_factory):
    if _ray_processes():
        pytest.skip("another Ray instance runs on this machine; the clean-up checks would see it")
    c = start_cluster(tmp_path_factory.mktemp("ray"), "--launcher", "ray", "--prefill", "1", "--decode", "1",
                      "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5",
                      "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                      "--max-replicas", "4")
    try:
        yield c
    finally:
        c.stop()


def dashboard(cluster: RunningCluster) -> str:
    (url,) = re.findall(r"Ray dashboard (http://\S+?)\)", cluster.log.read_text())
    return url


def ray_actors(cluster: RunningCluster) -> list[dict]:
    """`ray list actors` (the state API) for pdserve's namespace, alive ones."""
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "list", "actors", "--address", dashboard(cluster),
         "--format", "json", "--limit", "1000", "--filter", f"ray_namespace={NAMESPACE}", "--filter", "state=ALIVE"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_AUTH_MODE": "token"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def kill_actor(name: str) -> None:
    """ray.kill(actor) from a second driver on the same Ray instance."""
    code = ("import ray; ray.init(address='auto', namespace=%r, log_to_driver=False); "
            "ray.kill(ray.get_actor(%r), no_restart=True)" % (NAMESPACE, name))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_AUTH_MODE": "token"})
    assert out.returncode == 0, out.stderr[-2000:]


def _ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if any(p in line for p in RAY_PROCESSES) and "ps -eo" not in line]


def test_thirty_concurrent_greedy_requests_match_the_offline_engine_with_one_actor_per_component(
        ray_cluster, reference):
    roles = ensure_shape(ray_cluster, 1, 1)
    responses = asyncio.run(complete_all(ray_cluster.base_url, prompt_token_ids(), SHORT))
    assert len(responses) == 30
    assert [r.status_code for r in responses] == [200] * 30, [r.text for r in responses]
    assert {r.headers["x-pdserve-path"] for r in responses} == {"disaggregated"}
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == reference.short

    actors = ray_actors(ray_cluster)
    components = sorted((a["class_name"], a["name"]) for a in actors)
    (prefill,), (decode,) = worker_ids(roles, "prefill"), worker_ids(roles, "decode")
    assert components == sorted([("Controller", "controller"), ("DecodeWorker", decode), ("PrefillWorker", prefill),
                                 ("RedisActor", "redis"), ("Router", "router")])


def test_scale_to_two_and_back_under_streams_loses_nothing_and_frees_every_block(ray_cluster, reference):
    before = ensure_shape(ray_cluster, 1, 1)
    prompts = fresh_prompts()

    async def scenario():
        firsts = [asyncio.Event() for _ in prompts]
        async with httpx.AsyncClient(base_url=ray_cluster.base_url, timeout=300) as client:
            tasks = []
            for ids, first in zip(prompts[:8], firsts):
                tasks.append(asyncio.create_task(stream_completion(client, ids, LONG, first)))
                await asyncio.sleep(0.25)
            up = await asyncio.to_thread(ray_cluster.scale, prefill=2, decode=2)
            scaled_up = await asyncio.to_thread(ray_cluster.wait_for_roles, 240, prefill=2, decode=2)
            for ids, first in zip(prompts[8:], firsts[8:]):
                tasks.append(asyncio.create_task(stream_completion(client, ids, LONG, first)))
                await asyncio.sleep(0.25)
            deadline = time.monotonic() + 120
            while sum(f.is_set() for f in firsts[8:]) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            in_flight = sum(not t.done() for t in tasks)
            down = await asyncio.to_thread(ray_cluster.scale, prefill=1, decode=1)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return up, scaled_up, in_flight, down, results

    up, scaled_up, in_flight, down, results = asyncio.run(scenario())
    assert up.returncode == 0 and down.returncode == 0, up.stdout + up.stderr + down.stdout + down.stderr
    assert in_flight >= 1, "no stream was in flight when the cluster was scaled down"
    assert [(r.status, r.error, r.done) for r in results] == [(200, None, True)] * len(prompts)
    assert [r.token_ids for r in results] == reference.fresh
    assert len(worker_ids(scaled_up, "decode") - worker_ids(before, "decode")) == 1
    assert len(worker_ids(scaled_up, "prefill") - worker_ids(before, "prefill")) == 1

    after = ray_cluster.wait_for_roles(180, prefill=1, decode=1)
    assert_pools_empty(ray_cluster, worker_ids(after, "prefill") | worker_ids(after, "decode"))
    names = {a["name"] for a in ray_actors(ray_cluster)}
    assert names == {"controller", "redis", "router"} | worker_ids(after, "prefill") | worker_ids(after, "decode")


def test_a_decode_actor_killed_through_ray_fails_its_streams_explicitly_and_is_replaced(ray_cluster, reference):
    before = ensure_shape(ray_cluster, 1, 1)
    (victim,) = before["decode"]["workers"]
    prompts = prompt_token_ids()[:6]

    results, ended_within_s = streams_through_a_kill(ray_cluster, prompts, KILLED,
                                                     lambda: kill_actor(victim["worker_id"]))
    assert ended_within_s < 60, f"the streams took {ended_within_s:.1f} s to end after the kill"
    assert [r.status != 200 or (r.error is not None and r.done) for r in results] == [True] * len(prompts), results
    assert all(len(r.token_ids) < KILLED for r in results)

    after = wait_for_restart(ray_cluster, victim, before["decode"]["restarts"])
    (reborn,) = after["decode"]["workers"]
    assert reborn["worker_id"] == victim["worker_id"] and reborn["incarnation"] != victim["incarnation"]
    responses = asyncio.run(complete_all(ray_cluster.base_url, prompts, SHORT))
    assert [r.status_code for r in responses] == [200] * len(prompts), [r.text for r in responses]
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == reference.short[:6]
    assert_pools_empty(ray_cluster, worker_ids(after, "prefill") | worker_ids(after, "decode"))


def test_ctrl_c_drains_and_leaves_no_actor_process_or_port(ray_cluster):
    ray_cluster.refresh_workers()
    roles = ray_cluster.roles()
    ports = [ray_cluster.http_port, ray_cluster.grpc_port] + [
        int(address.rsplit(":", 1)[1]) for grpc, metrics in ray_cluster.workers.values() for address in (grpc, metrics)]
    ray_cluster.stop()
    assert ray_cluster.process.returncode == 0, ray_cluster.log.read_text()[-3000:]
    log = ray_cluster.log.read_text()
    assert "Traceback" not in log
    for worker_id in worker_ids(roles, "prefill") | worker_ids(roles, "decode"):
        assert f"worker {worker_id} drained and exited with code 0" in log
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == []
    assert [p for p in ports if not _port_free(p)] == []


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0
