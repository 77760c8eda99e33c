"""FanOut: merging backend streams, and aborting every request that is cut short."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from router.serving.backend import BackendRequest, TokenDelta
from router.errors import Overloaded, WorkerFailure
from router.serving.fanout import FanOut, run_shielded
from tests.unit.router_doubles import ScriptedBackend, token_steps


def requests(count: int) -> list[BackendRequest]:
    return [BackendRequest(f"r-{i}", (1, 2), SamplingParams()) for i in range(count)]


async def collect(fanout: FanOut) -> list[tuple[int, tuple[int, ...], str | None]]:
    out = []
    while (item := await fanout.next()) is not None:
        out.append((item[0], item[1].token_ids, item[1].finish_reason))
    return out


def test_deltas_of_two_streams_interleave_in_request_order():
    backend = ScriptedBackend(lambda r: token_steps([10, 11] if r.request_id == "r-0" else [20]))

    async def go():
        fanout = FanOut(backend, requests(2))
        merged = await collect(fanout)
        await fanout.aclose()
        return merged

    assert asyncio.run(go()) == [(0, (10,), None), (1, (20,), "length"), (0, (11,), "length")]
    assert backend.aborted == []


def test_stopping_a_stream_closes_it_and_aborts_its_request():
    backend = ScriptedBackend(token_steps([10, 11, 12]))

    async def go():
        fanout = FanOut(backend, requests(1))
        first = await fanout.next()
        await fanout.stop(0)
        rest = await fanout.next()
        await fanout.aclose()
        return first[1].token_ids, rest

    assert asyncio.run(go()) == ((10,), None)
    assert backend.aborted == ["r-0"]
    assert backend.closed == ["r-0"]


def test_closing_early_aborts_only_the_unfinished_requests():
    backend = ScriptedBackend(lambda r: token_steps([1] if r.request_id == "r-0" else [1, 2]))

    async def go():
        fanout = FanOut(backend, requests(2))
        await fanout.next()
        await fanout.next()
        await fanout.aclose()

    asyncio.run(go())
    assert backend.aborted == ["r-1"]


def test_a_stream_ending_without_finish_reason_is_a_worker_failure():
    backend = ScriptedBackend([TokenDelta((1,))])

    async def go():
        fanout = FanOut(backend, requests(1))
        try:
            await collect(fanout)
        finally:
            await fanout.aclose()

    with pytest.raises(WorkerFailure, match="backend stream of r-0 ended without a finish reason"):
        asyncio.run(go())
    assert backend.aborted == ["r-0"]


def test_a_backend_error_propagates_and_the_request_is_still_aborted():
    backend = ScriptedBackend([Overloaded("full", retry_after_s=2)])

    async def go():
        fanout = FanOut(backend, requests(1))
        try:
            await fanout.next()
        finally:
            await fanout.aclose()

    with pytest.raises(Overloaded):
        asyncio.run(go())
    assert backend.aborted == ["r-0"]


def test_a_cleanup_outlives_its_cancelled_caller_and_one_it_starts_runs_inline():
    done, tasks_seen = [], []

    async def inner():
        tasks_seen.append(asyncio.current_task())
        await asyncio.sleep(0.05)
        done.append("inner")

    async def outer():
        tasks_seen.append(asyncio.current_task())
        await run_shielded(inner())
        done.append("outer")

    async def go():
        caller = asyncio.ensure_future(run_shielded(outer()))
        await asyncio.sleep(0.01)
        caller.cancel()  # the client left: the cleanup goes on
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.2)
        # The caller's own later cleanups are not taken for nested ones.
        await run_shielded(inner())

    asyncio.run(go())
    assert done == ["inner", "outer", "inner"]
    assert tasks_seen[0] is tasks_seen[1]  # the nested cleanup ran in the outer cleanup's task
    assert tasks_seen[2] is not tasks_seen[0]
