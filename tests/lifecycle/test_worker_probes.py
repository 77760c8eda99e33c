"""A real WorkerProcess (tiny model, gloo data channel, real Redis) answers its Kubernetes
probes truthfully over HTTP on its metrics port: /startupz fails before the gRPC server serves,
/readyz waits for the first heartbeat and fails from the moment a drain starts, and /livez fails
within the stall bound when the engine loop thread is wedged (in a command, or in a step while a
request runs), and recovers when it moves again.

The process is served on this test's own event loop (the main thread, as `pdserve decode` does),
and the probes are fetched with real HTTP requests from worker threads."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from engine.loader.locate import default_model_path
from engine.sampling_params import SamplingParams
from pdserve.redis_server import EmbeddedRedis
from pdserve.specs import WorkerSpec
from proto.auth import load_cluster_secret
from router.cluster.redis_settings import PASSWORD_ENV
from tests.lifecycle.pd_pair import config, loop_held, prompt
from worker_runtime.process import WorkerProcess
from worker_runtime.status import WorkerState

pytestmark = pytest.mark.timeout(240)
PASSWORD = "probe-test-password"
STALL_S = 1.5


@pytest.fixture
def redis_url(monkeypatch) -> Iterator[str]:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded.url


def built(tiny_model_dir, redis_url: str | None) -> WorkerProcess:
    engine = config(tiny_model_dir, tokenizer=str(default_model_path()))
    spec = WorkerSpec(role="decode", engine=engine, worker_id="decode-probe", redis_url=redis_url,
                      cluster="probes", heartbeat_interval_s=0.3, heartbeat_ttl_s=2.0,
                      drain_timeout_s=5.0, liveness_stall_s=STALL_S)
    process = WorkerProcess(spec, load_cluster_secret())
    process.worker = process.role.build(spec, process._secret)  # what run() does before serve()
    return process


async def get(process: WorkerProcess, path: str) -> tuple[int, str]:
    def fetch() -> tuple[int, str]:
        reply = httpx.get(f"http://127.0.0.1:{process.metrics_port}{path}", timeout=10)
        return reply.status_code, reply.text

    return await asyncio.to_thread(fetch)


async def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False


async def served(process: WorkerProcess, body):
    """Run `body()` while `process` serves; then drain it and wait for serve() to return."""
    serving = asyncio.create_task(process.serve())
    try:
        assert await wait_for(lambda: _true(process.metrics_port is not None), 60), "no metrics server"
        return await body()
    finally:
        process.begin_drain(0.0)
        await asyncio.wait_for(serving, 30)


async def _true(value: bool) -> bool:
    return value


def test_startup_fails_until_the_grpc_server_serves_then_passes(tiny_model_dir):
    process = built(tiny_model_dir, None)
    process.worker.start()  # the loop runs; the gRPC server has not started
    try:
        process._start_metrics()
        before = asyncio.run(get(process, "/startupz")), asyncio.run(get(process, "/readyz"))
    finally:
        process._metrics_server.shutdown()
        process.worker.stop()
    assert before == ((503, "starting: the gRPC server is not serving yet\n"),
                      (503, "starting: not taking new requests\n"))

    async def body():
        return [await get(process, p) for p in ("/startupz", "/readyz", "/livez")]

    process = built(tiny_model_dir, None)
    assert asyncio.run(served(process, body)) == [(200, "ok\n")] * 3


def test_readiness_waits_for_registration_and_fails_from_the_start_of_a_drain(tiny_model_dir, redis_url,
                                                                              monkeypatch):
    # With nothing in flight the drain ends after the pause it gives routers to see it (0.2 s);
    # the three probes below must land inside it, which a loaded machine's thread hops did not
    # always do (a probe then met the stopped server). A longer pause keeps them inside.
    monkeypatch.setattr("worker_runtime.process.ROUTER_SNAPSHOT_PERIOD_S", 5.0)
    process = built(tiny_model_dir, redis_url)

    async def body():
        assert await wait_for(lambda: _is(get(process, "/readyz"), (200, "ok\n")), 30)
        assert process._heartbeat.beats >= 1
        metrics = (await get(process, "/metrics"))[1]
        process.begin_drain(5.0)
        await asyncio.sleep(0)  # the drain task marks the process DRAINING before its first await
        draining = await get(process, "/readyz"), await get(process, "/livez"), await get(process, "/startupz")
        return metrics, draining, process.state

    metrics, draining, state = asyncio.run(served(process, body))
    with pytest.raises(httpx.ConnectError):  # stopped: the port refuses, it does not hang a probe
        httpx.get(f"http://127.0.0.1:{process.metrics_port}/readyz", timeout=5)
    # /metrics still served
    assert re.search(r'^pdserve_worker_draining\{model_name="[^"]+",role="decode",worker_id="decode-probe"\} 0\.0$',
                     metrics, re.M), metrics
    assert state is WorkerState.DRAINING
    assert draining == ((503, "draining: not taking new requests\n"), (200, "ok\n"), (200, "ok\n"))


def test_a_wedged_engine_loop_fails_liveness_within_the_stall_bound_and_recovers(tiny_model_dir):
    process = built(tiny_model_dir, None)

    async def body():
        assert await get(process, "/livez") == (200, "ok\n")
        # The loop's last progress mark comes just before the holding command runs, a moment
        # before the block is entered: the stall is timed from there, so the test's own clock
        # starts before the command is submitted and allows that moment (a few ms) of slack.
        wedged_at = time.monotonic()
        with loop_held(process.worker):  # the loop thread blocks inside a command
            failed = await wait_for(lambda: _is_code(get(process, "/livez"), 503), STALL_S + 10)
            seconds = time.monotonic() - wedged_at
            live, ready = await get(process, "/livez"), await get(process, "/readyz")
        recovered = await wait_for(lambda: _is(get(process, "/livez"), (200, "ok\n")), 10)
        return failed, seconds, live, ready, recovered

    failed, seconds, live, ready, recovered = asyncio.run(served(process, body))
    assert failed and STALL_S - 0.1 <= seconds < STALL_S + 10
    assert live[0] == 503 and live[1].startswith("the engine loop has made no progress for ")
    assert float(live[1].split("no progress for ")[1].split(" s ")[0]) >= STALL_S  # never early by its own clock
    assert live[1].rstrip().endswith("(--liveness-stall 1.5; 0 steps so far)")
    assert ready[0] == 503 and ready[1].startswith("the engine loop has made no progress for ")  # serves nobody
    assert recovered


def test_a_step_that_never_returns_while_a_request_runs_fails_liveness(tiny_model_dir, monkeypatch):
    process = built(tiny_model_dir, None)
    release = threading.Event()
    real_step = process.worker.core.step

    def wedged_step():
        release.wait(30)
        return real_step()

    async def body():
        monkeypatch.setattr(process.worker.core, "step", wedged_step)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        _, outputs = await process.worker.admit("wedge-1", prompt(24, 1), params, 60.0, local_prefill=True)
        failed = await wait_for(lambda: _is_code(get(process, "/livez"), 503), STALL_S + 10)
        reason = (await get(process, "/livez"))[1]
        release.set()
        tokens = []
        while (item := await asyncio.wait_for(outputs.get(), 30)).finish_reason is None:
            tokens += item.new_token_ids
        tokens += item.new_token_ids
        recovered = await wait_for(lambda: _is(get(process, "/livez"), (200, "ok\n")), 10)
        return failed, reason, len(tokens), recovered

    failed, reason, n_tokens, recovered = asyncio.run(served(process, body))
    assert failed and reason.startswith("the engine loop has made no progress for ")
    assert (n_tokens, recovered) == (4, True)  # once the step returns, the request finishes


async def _is(call, expected) -> bool:
    return await call == expected


async def _is_code(call, code: int) -> bool:
    return (await call)[0] == code
