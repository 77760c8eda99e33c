"""Worker ports authenticate their callers: a real decode and a real prefill worker process
(tiny model, gloo), called over real gRPC without the cluster secret, with a wrong one, and with
the right one. Without it nothing is reserved, computed or handed out; health probes and
/metrics stay open; a worker without any secret refuses to start."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.loader.locate import default_model_path
from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, load_cluster_secret
from proto.internal_auth import internal_channel
from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.tiny_model import write_tiny_model
from tests.worker_process import stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120
SECRET = load_cluster_secret()  # tests/conftest.py sets it; the workers inherit it
WRONG = b"not-this-cluster-secret"
BLOCKS = 64
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 180)


def worker_cmd(role: str, model: Path, ready: Path) -> list[str]:
    return [sys.executable, "-m", "pdserve", role, "--model", str(model),
            "--tokenizer", str(default_model_path()), "--dtype", "float32",
            "--max-model-len", "512", "--num-gpu-blocks-override", str(BLOCKS),
            "--num-threads", "1", "--kv-transfer", "gloo", "--ready-file", str(ready)]



@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """{"decode": (grpc address, metrics port), "prefill": (...)}, both serving."""
    tmp = tmp_path_factory.mktemp("worker-auth")
    model = write_tiny_model(tmp / "tiny")
    processes, found = [], {}
    try:
        for role in ("decode", "prefill"):
            ready, log = tmp / f"{role}.ready", tmp / f"{role}.log"
            with log.open("w") as out:
                processes.append(subprocess.Popen(
                    worker_cmd(role, model, ready), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            found[role] = (processes[-1], ready, log)
        ports = {role: wait_ready(*found[role], START_TIMEOUT_S) for role in found}
        yield {role: (f"127.0.0.1:{g}", m) for role, (g, m) in ports.items()}
    finally:
        for process in processes:
            stop(process)


def channel(address: str, secret: bytes | None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address) if secret is None else internal_channel(address, secret)


async def decode_calls(address: str, secret: bytes | None) -> dict[str, grpc.StatusCode]:
    """Each DecodeWorker method's status code for a caller proving `secret` (None: no token)."""
    codes = {}
    async with channel(address, secret) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        calls = {
            "Decode": lambda: stub.Decode(worker_pb2.DecodeRequest(
                request_id="intruder", prompt_token_ids=PROMPT, sampling=GREEDY,
                ticket_timeout_ms=3_600_000)).read(),
            "OpenChannel": lambda: stub.OpenChannel(worker_pb2.OpenChannelRequest(
                prefill_worker_id="intruder", prefill_incarnation="x", backend="gloo")),
            "Abort": lambda: stub.Abort(worker_pb2.AbortRequest(request_id="intruder")),
            "GetLoad": lambda: stub.GetLoad(worker_pb2.LoadRequest()),
        }
        for name, call in calls.items():
            codes[name] = await status_of(call)
    return codes


async def prefill_calls(address: str, decode_address: str, secret: bytes | None) -> dict[str, grpc.StatusCode]:
    codes = {}
    ticket = worker_pb2.Ticket(ticket_id=1, decode_worker_id="d", decode_address=decode_address,
                               num_blocks=3, incarnation="x")
    async with channel(address, secret) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        calls = {
            "Prefill": lambda: stub.Prefill(worker_pb2.PrefillRequest(
                request_id="intruder", prompt_token_ids=PROMPT, sampling=GREEDY, ticket=ticket)),
            "Abort": lambda: stub.Abort(worker_pb2.AbortRequest(request_id="intruder")),
            "GetLoad": lambda: stub.GetLoad(worker_pb2.LoadRequest()),
        }
        for name, call in calls.items():
            codes[name] = await status_of(call)
    return codes


async def status_of(call) -> grpc.StatusCode:
    try:
        await asyncio.wait_for(call(), timeout=20)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def load(address: str, stub_type) -> worker_pb2.LoadReport:
    async with internal_channel(address, SECRET) as ch:
        return await stub_type(ch).GetLoad(worker_pb2.LoadRequest(), timeout=20)


async def settled_load(address: str, stub_type, limit_s: float = 20.0) -> worker_pb2.LoadReport:
    """The worker's load once nothing runs, waits or holds a reservation (its loop counts a
    finished or aborted request a moment later), or the last report after limit_s."""
    deadline = time.monotonic() + limit_s
    while (report := await load(address, stub_type)).num_running + report.num_waiting + (
            report.reserved_blocks) and (
            time.monotonic() < deadline):
        await asyncio.sleep(0.1)
    return report


@pytest.mark.parametrize("secret", [None, WRONG], ids=["no token", "wrong secret"])
def test_worker_calls_without_the_secret_are_unauthenticated_and_reserve_nothing(workers, secret):
    decode, prefill = workers["decode"][0], workers["prefill"][0]
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED

    async def body():
        await settled_load(decode, worker_pb2_grpc.DecodeWorkerStub)  # after earlier tests
        assert await decode_calls(decode, secret) == {
            "Decode": unauthenticated, "OpenChannel": unauthenticated, "Abort": unauthenticated,
            "GetLoad": unauthenticated}
        assert await prefill_calls(prefill, decode, secret) == {
            "Prefill": unauthenticated, "Abort": unauthenticated, "GetLoad": unauthenticated}
        d = await load(decode, worker_pb2_grpc.DecodeWorkerStub)
        p = await load(prefill, worker_pb2_grpc.PrefillWorkerStub)
        assert (d.total_blocks, d.reserved_blocks, d.num_running, d.num_waiting) == (BLOCKS, 0, 0, 0)
        assert (p.reserved_blocks, p.num_running, p.num_waiting) == (0, 0, 0)

    asyncio.run(body())


async def disaggregated_request(decode: str, prefill: str, request_id: str) -> tuple[int, list[int]]:
    """Decode (ticket) -> Prefill (P opens a channel on D and pushes the KV) -> decode stream:
    (the prefill's first token, every token id D streamed)."""
    async with internal_channel(decode, SECRET) as d_ch, internal_channel(prefill, SECRET) as p_ch:
        stream = worker_pb2_grpc.DecodeWorkerStub(d_ch).Decode(worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=GREEDY,
            ticket_timeout_ms=30_000), timeout=60)
        first = await stream.read()
        reply = await worker_pb2_grpc.PrefillWorkerStub(p_ch).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=GREEDY, ticket=first.ticket),
            timeout=60)
        tokens = []
        while (event := await stream.read()) is not grpc.aio.EOF:
            tokens += list(event.tokens.token_ids)
            if event.tokens.finish_reason:
                break
    return reply.first_token_id, tokens


def test_worker_calls_with_the_secret_serve_a_request_over_an_authenticated_kv_channel(workers):
    decode, prefill = workers["decode"][0], workers["prefill"][0]

    async def body():
        first, tokens = await disaggregated_request(decode, prefill, "with-secret-1")
        assert len(tokens) == 3  # max_tokens 4: the first came from P
        assert (await decode_calls(decode, SECRET))["GetLoad"] == grpc.StatusCode.OK
        d = await settled_load(decode, worker_pb2_grpc.DecodeWorkerStub)
        assert (d.reserved_blocks, d.num_running, d.num_waiting) == (0, 0, 0)
        # The same prompt again, greedy: the same tokens, through the channel P keeps open.
        assert await disaggregated_request(decode, prefill, "with-secret-2") == (first, tokens)

    asyncio.run(body())


@pytest.mark.parametrize("role,service", [("decode", "pdserve.v1.DecodeWorker"),
                                          ("prefill", "pdserve.v1.PrefillWorker")])
def test_worker_health_answers_without_a_token(workers, role, service):
    with grpc.insecure_channel(workers[role][0]) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=20)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_worker_metrics_stay_open_without_a_token(workers):
    for role in ("decode", "prefill"):
        reply = httpx.get(f"http://127.0.0.1:{workers[role][1]}/metrics", timeout=20)
        assert reply.status_code == 200
        assert "vllm:num_requests_running" in reply.text


@pytest.mark.parametrize("role", ["decode", "prefill", "router"])
def test_a_worker_or_router_without_the_cluster_secret_refuses_to_start_in_one_line(role):
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV)}
    extra = ["--redis-url", "redis://127.0.0.1:1/0"] if role == "router" else []
    done = subprocess.run([sys.executable, "-m", "pdserve", role, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    program = f"pdserve {role}"
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"{program}: no cluster secret: set PDSERVE_CLUSTER_SECRET (the secret) or "
        "PDSERVE_CLUSTER_SECRET_FILE (a file holding it) in the environment; every router and "
        "worker of a cluster needs the same one (pdserve up generates it for its children)"]
