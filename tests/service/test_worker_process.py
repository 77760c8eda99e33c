"""A worker process started from a WorkerSpec (`python -m pdserve <spec.to_argv()>`), with a real
Redis and real gRPC calls: it registers as serving, drains on SIGTERM (marked "draining" in
Redis, in-flight work finishes, exit 0, entry deleted), and a second signal stops it at once.

The workers run the tiny random-weight model (tests/tiny_model.py): the tests are about the
process's lifecycle, not the tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.loader.locate import default_model_path
from pdserve.redis_server import EmbeddedRedis
from pdserve.specs import WorkerSpec
from proto.auth import load_cluster_secret
from proto.internal_auth import internal_channel
from proto.link import LinkChannel, LinkDecodeStub
from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.cluster.keys import WorkerInfo, worker_key, workers_set_key
from router.cluster.redis_settings import PASSWORD_ENV, sync_client
from tests.tiny_model import write_tiny_model
from tests.worker_process import stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "wp"
PASSWORD = "worker-process-test-password"
START_TIMEOUT_S = 120
EXIT_TIMEOUT_S = 30

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def redis_url(monkeypatch) -> Iterator[str]:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)  # the workers and this test's client read it
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded.url


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """Worker processes a test starts; stopped at teardown even when the test fails."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def decode_spec(model: Path, redis_url: str, tmp: Path, drain_timeout_s: float = 60.0,
                role: str = "decode") -> WorkerSpec:
    engine = EngineConfig(model=str(model), tokenizer=str(default_model_path()), dtype="float32",
                          max_model_len=1024, num_gpu_blocks_override=256, num_threads=1)
    return WorkerSpec(role=role, engine=engine, worker_id=f"{role}-wp", redis_url=redis_url,
                      cluster=CLUSTER, heartbeat_interval_s=0.5, heartbeat_ttl_s=3.0,
                      drain_timeout_s=drain_timeout_s, ready_file=str(tmp / "ready"))


def start(spec: WorkerSpec, tmp: Path, started: list[subprocess.Popen]) -> tuple[subprocess.Popen, Path, int, int]:
    log = tmp / "worker.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pdserve", *spec.to_argv()], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    started.append(process)
    grpc_port, metrics_port = wait_ready(process, Path(spec.ready_file), log, START_TIMEOUT_S)
    return process, log, grpc_port, metrics_port


def registered(redis_url: str, worker_id: str) -> WorkerInfo | None:
    client = sync_client(redis_url)
    try:
        data = client.hgetall(worker_key(CLUSTER, worker_id))
        return WorkerInfo.from_hash(data) if data else None
    finally:
        client.close()


def in_workers_set(redis_url: str, worker_id: str) -> bool:
    client = sync_client(redis_url)
    try:
        return bool(client.sismember(workers_set_key(CLUSTER), worker_id))
    finally:
        client.close()


def wait_for_state(redis_url: str, worker_id: str, state: str, timeout_s: float = 10.0) -> float:
    """Seconds until the worker's Redis entry shows `state` (bounded)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        info = registered(redis_url, worker_id)
        if info is not None and info.state == state:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{worker_id} not {state} in Redis within {timeout_s} s: {registered(redis_url, worker_id)}")


def worker_gauges(metrics_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("pdserve_worker_")}


def decode_request(request_id: str, max_tokens: int, local_prefill: bool) -> worker_pb2.DecodeRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=list(range(10, 42)),
                                    sampling=sampling, ticket_timeout_ms=120_000, local_prefill=local_prefill)


def log_lines(log: Path, needle: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if needle in line]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_from_a_spec_registers_as_serving_and_sigterm_unregisters_it(tiny_model_dir, redis_url,
                                                                              tmp_path, started, role):
    spec = decode_spec(tiny_model_dir, redis_url, tmp_path, role=role)
    if role == "prefill":  # no worker link: routers call it over gRPC
        spec = dataclasses.replace(spec, link_port=-1)
    process, log, grpc_port, metrics_port = start(spec, tmp_path, started)
    wait_for_state(redis_url, f"{role}-wp", "serving", timeout_s=30)  # the first beat may land after the ready file
    info = registered(redis_url, f"{role}-wp")
    assert info is not None, log.read_text()
    assert (info.role, info.state, info.address, info.block_size, info.total_blocks) == (
        role, "serving", f"127.0.0.1:{grpc_port}", 16, 256)
    assert (info.link_address == "") is (role == "prefill"), info
    assert info.metrics_address == f"127.0.0.1:{metrics_port}"
    assert worker_gauges(metrics_port) == {"pdserve_worker_in_flight": 0.0, "pdserve_worker_draining": 0.0}
    # the model and tokenizer frozen out of the collector's view before serving (proto/heap.py)
    assert len(log_lines(log, "start-up objects frozen out of the garbage collector's view")) == 1

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log.read_text()
    assert registered(redis_url, f"{role}-wp") is None
    assert not in_workers_set(redis_url, f"{role}-wp")
    assert len(log_lines(log, f"{role} worker {role}-wp draining: 0 in flight, timeout 60 s")) == 1
    assert len(log_lines(log, "0 finished, 0 aborted at the timeout")) == 1


def test_a_decode_worker_serves_the_same_greedy_tokens_over_its_link_as_over_grpc(
        tiny_model_dir, redis_url, tmp_path, started):
    """The routers' request plane (proto/link) runs the worker's own servicer: same tokens."""
    process, log, grpc_port, _ = start(decode_spec(tiny_model_dir, redis_url, tmp_path), tmp_path, started)
    wait_for_state(redis_url, "decode-wp", "serving", timeout_s=30)
    info = registered(redis_url, "decode-wp")
    host, link_port = info.link_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(link_port) not in (0, grpc_port), info
    assert f"link {info.link_address}" in log.read_text()

    async def tokens(stub, request_id: str) -> list[int]:
        stream = stub.Decode(decode_request(request_id, 12, local_prefill=True))
        ids = []
        while (event := await stream.read()) is not grpc.aio.EOF:
            ids += list(event.tokens.token_ids) if event.HasField("tokens") else []
        return ids

    async def both() -> tuple[list[int], list[int]]:
        secret = load_cluster_secret()
        async with internal_channel(info.address, secret) as g, LinkChannel(info.link_address, secret) as link:
            return (await tokens(worker_pb2_grpc.DecodeWorkerStub(g), "over-grpc"),
                    await tokens(LinkDecodeStub(link), "over-link"))

    over_grpc, over_link = asyncio.run(both())
    assert len(over_grpc) == 12 and over_link == over_grpc
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log.read_text()


def test_sigterm_marks_the_worker_draining_then_its_stream_finishes_and_it_exits_zero(
        tiny_model_dir, redis_url, tmp_path, started):
    max_tokens = 600
    spec = decode_spec(tiny_model_dir, redis_url, tmp_path)
    process, log, grpc_port, _ = start(spec, tmp_path, started)

    async def stream_across_sigterm() -> tuple[list[int], str, int, float]:
        async with internal_channel(f"127.0.0.1:{grpc_port}", load_cluster_secret()) as channel:
            call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(decode_request("drain-1", max_tokens, True))
            events = call.__aiter__()
            assert (await events.__anext__()).HasField("ticket")
            tokens = list((await events.__anext__()).tokens.token_ids)
            process.send_signal(signal.SIGTERM)
            draining_after_s = await asyncio.to_thread(wait_for_state, redis_url, "decode-wp", "draining")
            at_draining = len(tokens)
            finish = ""
            async for event in events:
                tokens += event.tokens.token_ids
                finish = event.tokens.finish_reason
            return tokens, finish, at_draining, draining_after_s

    tokens, finish, at_draining, draining_after_s = asyncio.run(stream_across_sigterm())
    assert (len(tokens), finish) == (max_tokens, "length")
    assert at_draining < max_tokens, "the stream was still in flight when Redis showed the worker draining"
    assert draining_after_s < 2.0  # published at once, not at the next beat or after the drain
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log.read_text()
    assert registered(redis_url, "decode-wp") is None
    assert len(log_lines(log, "decode worker decode-wp draining: 1 in flight")) == 1
    assert len(log_lines(log, "1 finished, 0 aborted at the timeout")) == 1


def test_a_second_sigterm_during_the_drain_stops_the_worker_at_once(tiny_model_dir, redis_url, tmp_path,
                                                                   started):
    spec = decode_spec(tiny_model_dir, redis_url, tmp_path, drain_timeout_s=120.0)
    process, log, grpc_port, metrics_port = start(spec, tmp_path, started)

    async def reserve_then_signal_twice() -> tuple[grpc.StatusCode, float, dict[str, float]]:
        async with internal_channel(f"127.0.0.1:{grpc_port}", load_cluster_secret()) as channel:
            # A reservation no prefill will fill: the drain would wait for it (up to 120 s).
            call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(decode_request("held-1", 8, False))
            events = call.__aiter__()
            assert (await events.__anext__()).ticket.num_blocks == 2
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_for_state, redis_url, "decode-wp", "draining")
            gauges = await asyncio.to_thread(worker_gauges, metrics_port)
            second_at = time.monotonic()
            process.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in events:
                    pass
            return ended.value.code(), second_at, gauges

    code, second_at, gauges = asyncio.run(reserve_then_signal_twice())
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 1, log.read_text()
    assert time.monotonic() - second_at < 15.0  # not the 120 s drain timeout
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert gauges == {"pdserve_worker_in_flight": 1.0, "pdserve_worker_draining": 1.0}
    assert registered(redis_url, "decode-wp") is None
    assert len(log_lines(log, "SIGTERM again: stopping at once, 1 request(s) in flight end with an error")) == 1


def test_worker_stopped_by_sigint_when_idle_exits_zero(tiny_model_dir, redis_url, tmp_path, started):
    """tests/worker_process.stop (SIGINT) still stops an idle worker promptly: SIGINT drains too."""
    spec = decode_spec(tiny_model_dir, redis_url, tmp_path)
    process, log, _, _ = start(spec, tmp_path, started)
    begun = time.monotonic()
    stop(process)
    assert process.returncode == 0, log.read_text()
    assert time.monotonic() - begun < 15.0
    assert registered(redis_url, "decode-wp") is None


def test_the_drain_hook_a_servicer_receives_drains_and_stops_the_process_once(tiny_model_dir):
    """The Drain RPC's path: the servicer calls the request_drain it was constructed with. Run in
    this process with the real WorkerProcess and DecodeWorker (no Redis, the `local` backend);
    only the role's servicer factory is wrapped, to capture the hook."""
    from worker_runtime.builders import decode_servicer
    from worker_runtime.process import WorkerProcess
    from worker_runtime.status import WorkerState

    hooks = []

    def hooked_servicer(worker, address, request_drain):
        hooks.append(request_drain)
        return decode_servicer(worker, address, request_drain)

    engine = EngineConfig(model=str(tiny_model_dir), tokenizer=str(default_model_path()), dtype="float32",
                          max_model_len=1024, num_gpu_blocks_override=64, num_threads=1)
    spec = WorkerSpec(role="decode", engine=engine, worker_id="decode-hook", kv_transfer="local", drain_timeout_s=5.0)
    process = WorkerProcess(spec, load_cluster_secret())
    process.role = dataclasses.replace(process.role, make_servicer=hooked_servicer)
    process.worker = process.role.build(spec, load_cluster_secret())

    async def drain_through_the_hook():
        serving = asyncio.create_task(process.serve())
        for _ in range(500):
            if process.state is WorkerState.SERVING:
                break
            await asyncio.sleep(0.01)
        first, again = hooks[0](None), hooks[0](1.0)
        return first, again, await asyncio.wait_for(serving, 30)

    first, again, code = asyncio.run(drain_through_the_hook())
    assert (len(hooks), first, again, code) == (1, (True, 0), (False, 0), 0)
    assert process.state is WorkerState.STOPPED
    assert process.drain_result is not None and (process.drain_result.finished, process.drain_result.aborted) == (0, 0)


def test_a_signal_while_the_servers_start_drains_once_they_are_up_and_exits_zero(tiny_model_dir):
    """A supervisor may signal the moment it sees the ready file (or sooner): the handlers are in
    place before the servers start, and a first signal then drains once they are up (exit 0), not
    asyncio.run's KeyboardInterrupt. In this process: SIGINT sent to itself from inside _start."""
    from worker_runtime.process import WorkerProcess
    from worker_runtime.status import WorkerState

    engine = EngineConfig(model=str(tiny_model_dir), tokenizer=str(default_model_path()), dtype="float32",
                          max_model_len=1024, num_gpu_blocks_override=64, num_threads=1)
    spec = WorkerSpec(role="decode", engine=engine, worker_id="decode-early", kv_transfer="local", drain_timeout_s=5.0)
    process = WorkerProcess(spec, load_cluster_secret())
    process.worker = process.role.build(spec, load_cluster_secret())
    start_servers = process._start

    async def signalled_while_starting() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # handled on the loop at _start's first await
        await start_servers()

    process._start = signalled_while_starting
    code = asyncio.run(asyncio.wait_for(process.serve(), 30))
    assert code == 0 and process.state is WorkerState.STOPPED
    assert process.drain_result is not None and (process.drain_result.finished, process.drain_result.aborted) == (0, 0)


def test_drain_rpc_past_its_timeout_ends_the_held_request_with_an_error_and_the_process_exits_zero(
        tiny_model_dir, redis_url, tmp_path, started):
    spec = decode_spec(tiny_model_dir, redis_url, tmp_path)
    process, log, grpc_port, _ = start(spec, tmp_path, started)

    async def hold_then_drain() -> tuple[worker_pb2.DrainResponse, worker_pb2.DrainResponse, grpc.aio.AioRpcError]:
        async with internal_channel(f"127.0.0.1:{grpc_port}", load_cluster_secret()) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            # A reservation no prefill will fill: only the drain's timeout (1 s, not the spec's 60) ends it.
            events = stub.Decode(decode_request("held-2", 8, False)).__aiter__()
            assert (await events.__anext__()).ticket.num_blocks == 2
            first = await stub.Drain(worker_pb2.DrainRequest(timeout_ms=1000), timeout=10)
            again = await stub.Drain(worker_pb2.DrainRequest(), timeout=10)
            await asyncio.to_thread(wait_for_state, redis_url, "decode-wp", "draining")
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in events:
                    pass
            return first, again, ended.value

    first, again, ended = asyncio.run(hold_then_drain())
    assert (first.started, first.in_flight, again.started) == (True, 1, False)
    assert ended.code() == grpc.StatusCode.UNAVAILABLE and "drain" in ended.details(), ended.details()
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log.read_text()
    assert registered(redis_url, "decode-wp") is None
    assert len(log_lines(log, "0 finished, 1 aborted at the timeout")) == 1
