"""Issue 11's acceptance: `pdserve up --prefill 1 --decode 1` scaled at run time through the
public API, with the real model, real processes and real Redis.

One cluster for the module; the tests run in order and each first brings the cluster to the
shape it needs (so one failure does not cascade): 1+1 -> `pdserve scale prefill=2 decode=2`
-> scaled back to 1+1 under streaming load -> a decode worker SIGKILLed under load and brought
back by the supervisor. Tokens are compared with the offline engine's greedy tokens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.e2e.cluster import start_cluster
from tests.e2e.load import (Reference, assert_pools_empty, complete_all, decisions, delta, ensure_shape,
                            fresh_prompts, offline_reference, stream_completion, streams_through_a_kill,
                            wait_for_restart, worker_ids)
from tests.real_model import prompt_token_ids

pytestmark = pytest.mark.slow

SHORT, LONG, KILLED = 16, 64, 400
"""max_tokens of the scale-up burst, of the streams scaled down under, of the streams killed."""
MAX_REPLICAS = 4
ARRIVAL_GAP_S = 0.25


@pytest.fixture(scope="module")
def reference() -> Reference:
    return offline_reference(SHORT, LONG)


@pytest.fixture(scope="module")
def cluster(reference, tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("scaling"), "--prefill", "1", "--decode", "1",
                      "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                      "--max-replicas", str(MAX_REPLICAS))
    children: list[int] = []
    try:
        yield c
        children = _children(c.process.pid)
    finally:
        c.stop()
    time.sleep(1)
    assert [pid for pid in children if _alive(pid)] == [], "processes of pdserve up left running"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("replicas, message", [
    (-1, "replicas must be >= 0; got -1"),
    (1.5, "replicas must be an integer; got 1.5"),
    ("two", "replicas must be an integer; got 'two'"),
    (True, "replicas must be an integer; got True"),
    (MAX_REPLICAS + 1, f"replicas must be <= {MAX_REPLICAS} (--max-replicas); got {MAX_REPLICAS + 1}"),
], ids=["negative", "fraction", "string", "bool", "above-max"])
def test_put_role_with_bad_replicas_is_400_with_the_reason_and_changes_nothing(cluster, replicas, message):
    desired = cluster.roles()["decode"]["desired"]
    r = cluster.put_replicas("decode", replicas)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": "replicas", "code": 400}}
    assert cluster.roles()["decode"]["desired"] == desired


def test_scale_up_registers_both_new_workers_within_60_s_and_they_serve(cluster, reference):
    before = ensure_shape(cluster, 1, 1)
    decode_before, prefill_before = decisions(cluster, "decode"), decisions(cluster, "prefill")
    started = time.monotonic()
    done = cluster.scale(prefill=2, decode=2)
    assert done.returncode == 0, done.stdout + done.stderr
    roles = cluster.wait_for_roles(180, prefill=2, decode=2)
    took_s = time.monotonic() - started
    new = {role: worker_ids(roles, role) - worker_ids(before, role) for role in ("prefill", "decode")}
    assert [len(new["prefill"]), len(new["decode"])] == [1, 1], roles
    assert took_s < 60, f"the new workers took {took_s:.1f} s to serve"
    registered = cluster.cluster_workers()
    assert new["prefill"] | new["decode"] <= set(registered), registered

    responses = asyncio.run(complete_all(cluster.base_url, prompt_token_ids(), SHORT))
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text for r in responses]
    assert {r.headers["x-pdserve-path"] for r in responses} == {"disaggregated"}
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == reference.short
    got_decode = delta(decisions(cluster, "decode"), decode_before)
    got_prefill = delta(decisions(cluster, "prefill"), prefill_before)
    assert set(got_decode) == worker_ids(roles, "decode"), got_decode  # both decode workers got some
    assert set(got_prefill) == worker_ids(roles, "prefill"), got_prefill
    assert sum(got_decode.values()) == len(responses)


def test_scale_down_under_16_streams_completes_all_with_the_same_tokens_and_frees_every_block(
        cluster, reference):
    before = ensure_shape(cluster, 2, 2)
    prompts = fresh_prompts()

    async def scenario():
        firsts = [asyncio.Event() for _ in prompts]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as client:
            tasks = []
            for ids, first in zip(prompts, firsts):
                # Arrivals spread over ~4 s, as real ones are: a burst sent in one instant is
                # placed from one cluster snapshot, all on the same decode worker.
                tasks.append(asyncio.create_task(stream_completion(client, ids, LONG, first)))
                await asyncio.sleep(ARRIVAL_GAP_S)
            # Scale down once half the streams have a token: the rest are still being
            # prefilled or transferred, so both the prefill and the decode drain have work.
            deadline = time.monotonic() + 120
            while sum(f.is_set() for f in firsts) < len(prompts) // 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            in_flight = sum(not t.done() for t in tasks)
            scaled = await asyncio.to_thread(cluster.scale, prefill=1, decode=1)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return in_flight, scaled, results

    in_flight, scaled, results = asyncio.run(scenario())
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert in_flight >= len(prompts) // 2, f"only {in_flight} streams were in flight at the scale-down"
    assert [(r.status, r.error, r.done) for r in results] == [(200, None, True)] * len(prompts)
    assert [r.token_ids for r in results] == reference.fresh

    after = cluster.wait_for_roles(180, prefill=1, decode=1)
    (removed_prefill,) = worker_ids(before, "prefill") - worker_ids(after, "prefill")
    (removed_decode,) = worker_ids(before, "decode") - worker_ids(after, "decode")
    placed = [r.decode_id for r in results]
    assert removed_decode in placed, f"the removed decode worker got none of the streams: {placed}"
    removed = (removed_prefill, removed_decode)
    assert cluster.wait_for_exit(removed) == {w: [] for w in removed}
    assert_pools_empty(cluster, worker_ids(after, "prefill") | worker_ids(after, "decode"))


def test_sigkilled_decode_worker_fails_its_streams_explicitly_and_is_restarted(cluster, reference):
    before = ensure_shape(cluster, 1, 1)
    (victim,) = before["decode"]["workers"]
    prompts = prompt_token_ids()[:6]

    results, ended_within_s = streams_through_a_kill(
        cluster, prompts, KILLED, lambda: os.kill(cluster.worker_pid(victim["worker_id"]), signal.SIGKILL))
    assert ended_within_s < 60, f"the streams took {ended_within_s:.1f} s to end after the kill"
    explicit = [r.status != 200 or (r.error is not None and r.done) for r in results]
    assert explicit == [True] * len(prompts), results
    assert all(len(r.token_ids) < KILLED for r in results)

    after = wait_for_restart(cluster, victim, before["decode"]["restarts"])
    (reborn,) = after["decode"]["workers"]
    assert reborn["incarnation"] != victim["incarnation"]
    responses = asyncio.run(complete_all(cluster.base_url, prompts, SHORT))
    assert [r.status_code for r in responses] == [200] * len(prompts), [r.text for r in responses]
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == reference.short[:6]
    assert_pools_empty(cluster, worker_ids(after, "prefill") | worker_ids(after, "decode"))
