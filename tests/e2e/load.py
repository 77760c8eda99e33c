"""Load and checks shared by the scaling acceptance tests (local processes and Ray): streamed
and unary greedy completions against `pdserve up`, the cluster brought to a shape, pools
checked empty, a restart waited for."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tests.e2e.cluster import RunningCluster, metric_by_label
from tests.real_model import hf_tokenizer, prompt_token_ids

MODEL = "SmolLM2-135M-Instruct"
DECISIONS = "pdserve_routing_decisions_total"


def fresh_prompts() -> list[list[int]]:
    """16 of the test prompts behind a distinct first line: no worker holds any of their
    blocks (the prefix hash chains from the first token), so routing is not pinned by the
    prefix cache to the worker that served the same prompt earlier in the module."""
    tok = hf_tokenizer()
    return [tok(f"Note {i}.\n", add_special_tokens=False)["input_ids"] + list(ids)
            for i, ids in enumerate(prompt_token_ids()[:16])]


@dataclass
class StreamResult:
    status: int
    token_ids: list[int]
    error: dict | str | None
    """The in-band `error` object of the SSE stream, or the body of a non-200 answer."""
    done: bool
    """The stream ended with `data: [DONE]`."""
    decode_id: str | None = None
    """The decode worker the router placed it on (its x-pdserve-route header)."""


async def stream_completion(client: httpx.AsyncClient, ids, max_tokens: int,
                            first_token: asyncio.Event | None = None) -> StreamResult:
    body = {"model": MODEL, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    result = StreamResult(0, [], None, False)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        result.status = r.status_code
        route = dict(part.split("=", 1) for part in r.headers.get("x-pdserve-route", "").split("; ") if "=" in part)
        result.decode_id = route.get("decode")
        if r.status_code != 200:
            result.error = (await r.aread()).decode()
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"]
                continue
            for choice in chunk["choices"]:
                result.token_ids += choice.get("token_ids") or []
            if result.token_ids and first_token is not None:
                first_token.set()
    return result


async def complete_all(base_url: str, prompts, max_tokens: int) -> list[httpx.Response]:
    """All prompts at once, non-streamed, greedy."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json={
            "model": MODEL, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}) for ids in prompts))


def ensure_shape(cluster: RunningCluster, prefill: int, decode: int) -> dict[str, dict]:
    """Bring the cluster to prefill+decode (no-op when it is there already)."""
    roles = cluster.roles()
    if (roles["prefill"]["desired"], roles["decode"]["desired"]) != (prefill, decode):
        done = cluster.scale(prefill=prefill, decode=decode)
        assert done.returncode == 0, done.stdout + done.stderr
    return cluster.wait_for_roles(180, prefill=prefill, decode=decode)


def worker_ids(roles: dict[str, dict], role: str) -> set[str]:
    return {w["worker_id"] for w in roles[role]["workers"]}


def decisions(cluster: RunningCluster, label: str) -> dict[str, float]:
    return metric_by_label(cluster.metrics(), DECISIONS, label)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def assert_pools_empty(cluster: RunningCluster, workers: set[str]) -> None:
    pools = cluster.wait_for_empty_pools(timeout_s=30)
    assert set(pools) == workers
    assert {w: (free, reserved) for w, (total, free, reserved) in pools.items()} == \
        {w: (total, 0.0) for w, (total, _, _) in pools.items()}, pools


def wait_for_restart(cluster: RunningCluster, victim: dict, restarts_before: int,
                     timeout_s: float = 180) -> dict[str, dict]:
    """Until the supervisor counted a decode restart and a new incarnation serves; bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        roles = cluster.roles()
        decode = roles["decode"]
        fresh = [w for w in decode["workers"] if w["incarnation"] != victim["incarnation"]]
        if decode["restarts"] > restarts_before and fresh and decode["ready"] == decode["desired"] == 1:
            return cluster.wait_for_roles(60, prefill=1, decode=1)
        if time.monotonic() > deadline:
            raise AssertionError(f"no restarted decode worker in {timeout_s:.0f} s: {roles}")
        time.sleep(0.5)


@dataclass(frozen=True)
class Reference:
    short: list[list[int]]
    """Greedy tokens of each of the 30 test prompts (the shorter length)."""
    fresh: list[list[int]]
    """Greedy tokens of each fresh prompt (the longer length)."""


def offline_reference(short_len: int, fresh_len: int) -> Reference:
    """The offline engine's greedy tokens; call it before a cluster starts, so the two do not
    share the cores."""
    from engine import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    short = llm.generate([list(p) for p in prompt_token_ids()], greedy(short_len))
    fresh = llm.generate(fresh_prompts(), greedy(fresh_len))
    del llm
    return Reference([list(o.token_ids) for o in short], [list(o.token_ids) for o in fresh])


def streams_through_a_kill(cluster: RunningCluster, prompts, max_tokens: int,
                           kill: Callable[[], None]) -> tuple[list[StreamResult], float]:
    """Stream every prompt; once each has its first token, call `kill` (blocking, off the event
    loop); return the streams' results and how long after the kill they all ended (bounded)."""
    async def scenario():
        firsts = [asyncio.Event() for _ in prompts]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as client:
            tasks = [asyncio.create_task(stream_completion(client, ids, max_tokens, first))
                     for ids, first in zip(prompts, firsts)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            await asyncio.to_thread(kill)
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return results, time.monotonic() - killed_at

    return asyncio.run(scenario())
