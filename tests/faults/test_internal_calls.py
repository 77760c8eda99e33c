"""The router's calls to workers, against scripted in-process gRPC workers (no model): only a
decode worker's marked no-room refusal queues a request; a message gRPC refuses as too large is
an immediate 400 that never holds the admission queue (issue 10, item 6); a silent decode
stream or prefill ends within its deadline with an explicit error or fallback (item 1); the
decode worker clamps the ticket lifetime a caller asks for (item 4)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from decode_worker.servicer import MAX_TICKET_TIMEOUT_S, DecodeWorkerServicer, ticket_timeout_s
from engine.core import CoreStats
from engine.sampling_params import SamplingParams
from proto.limits import NO_ROOM_METADATA_KEY
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.routing.admission import AdmissionQueue, AdmissionSettings
from router.serving.backend import BackendRequest
from router.routing.cluster_backend import ClusterBackend
from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.errors import InvalidRequest, WorkerFailure
from router.routing.policy import RouteDecision
from router.routing.worker_calls import WorkerSilent, WorkerTimeouts
from worker_runtime.status import TransferTotals, WorkerState, WorkerStatus

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TOKENS = (7, 8, 9)


class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Refuses the first `no_room` calls (marked no-room), then tickets and streams TOKENS;
    `silent_after` tokens, it goes quiet; `hang_ticketed` holds non-local streams open."""

    def __init__(self, no_room: int = 0, silent_after: int | None = None) -> None:
        self.no_room = no_room
        self.silent_after = silent_after
        self.calls = 0
        self.aborted: list[str] = []

    async def Decode(self, request, context):
        self.calls += 1
        if self.calls <= self.no_room:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room now",
                                trailing_metadata=((NO_ROOM_METADATA_KEY, "1"),))
        yield worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(ticket_id=0 if request.local_prefill else 5))
        if not request.local_prefill:
            await asyncio.sleep(3600)  # waits for a prefill that never comes
        for k, token in enumerate(TOKENS):
            if k == self.silent_after:
                await asyncio.sleep(3600)
            yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(
                token_ids=[token], finish_reason="length" if k == len(TOKENS) - 1 else "", stop_token_id=-1))

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(aborted=True)


class SilentPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    async def Prefill(self, request, context):
        await asyncio.sleep(3600)

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=True)


def _info(worker_id: str, role: str, port: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{port}", metrics_address="",
                      incarnation="i1", block_size=16, total_blocks=1000, free_blocks=1000, reserved_blocks=0,
                      cached_blocks=0, num_running=0, num_waiting=0, queued_prefill_tokens=0,
                      max_model_len=4096, updated_at=time.time())


async def _serve(add, servicer, max_receive: int = 4 * 1024 * 1024):
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_receive)])
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _backend(workers, prefill_id=None, timeouts=WorkerTimeouts(), max_wait_s=20.0) -> ClusterBackend:
    snapshot = ClusterSnapshot(workers=tuple(workers), taken_at=time.monotonic(), stale=False)

    async def snap():
        return snapshot

    def choose(route, snap, rng):
        return RouteDecision(prefill_id, "d1", "scripted", ())

    admission = AdmissionQueue(AdmissionSettings(max_wait_s=max_wait_s, poll_interval_s=0.05))
    return ClusterBackend(snap, choose, admission=admission, timeouts=timeouts)


async def _tokens(backend: ClusterBackend, request_id: str, params: SamplingParams = PARAMS):
    out = []
    async for delta in backend.generate(BackendRequest(request_id, (1, 2, 3, 4), params)):
        out.extend(delta.token_ids)
    return tuple(out)


def test_a_message_too_large_for_the_decode_worker_is_an_immediate_400_and_others_are_not_delayed():
    async def run():
        decode = ScriptedDecode()
        server, port = await _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, decode, 64 * 1024)
        backend = _backend([_info("d1", "decode", port)])
        huge = SamplingParams(temperature=0.0, max_tokens=3, stop=tuple("x" * 1000 + str(i) for i in range(200)))
        start = time.monotonic()
        big = asyncio.create_task(_tokens(backend, "big", huge))
        small = asyncio.create_task(_tokens(backend, "small"))
        with pytest.raises(InvalidRequest, match="too large for the cluster's internal messages"):
            await asyncio.wait_for(big, 5)
        assert await asyncio.wait_for(small, 5) == TOKENS
        elapsed = time.monotonic() - start
        queue = backend.admission
        await backend.close()
        await server.stop(None)
        return elapsed, queue.num_waiting, dict(queue.rejections), backend.transfers.decode_rejections

    elapsed, waiting, rejections, decode_rejections = asyncio.run(run())
    assert elapsed < 5.0
    assert (waiting, rejections, decode_rejections) == (0, {}, 0)


def test_a_marked_no_room_refusal_queues_until_the_decode_worker_takes_it():
    async def run():
        decode = ScriptedDecode(no_room=2)
        server, port = await _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, decode)
        backend = _backend([_info("d1", "decode", port)])
        tokens = await asyncio.wait_for(_tokens(backend, "r1"), 10)
        await backend.close()
        await server.stop(None)
        return tokens, backend.transfers.decode_rejections, backend.admission.admitted_after_wait, decode.calls

    assert asyncio.run(run()) == (TOKENS, 2, 1, 3)


def test_a_decode_stream_silent_past_the_idle_timeout_ends_with_an_explicit_error():
    async def run():
        decode = ScriptedDecode(silent_after=1)
        server, port = await _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, decode)
        backend = _backend([_info("d1", "decode", port)], timeouts=WorkerTimeouts(prefill_s=0.5, stream_idle_s=0.5))
        got, start = [], time.monotonic()
        with pytest.raises(WorkerSilent, match="decode worker d1 sent nothing for 0.5 s"):
            async for delta in backend.generate(BackendRequest("r1", (1, 2, 3, 4), PARAMS)):
                got.extend(delta.token_ids)
        elapsed = time.monotonic() - start
        for _ in range(100):
            if decode.aborted:
                break
            await asyncio.sleep(0.02)
        await backend.close()
        await server.stop(None)
        return got, elapsed, decode.aborted, backend.admission.free_rate.per_second() > 0

    got, elapsed, aborted, freed = asyncio.run(run())
    assert got == [7]
    assert 0.45 <= elapsed < 3.0  # one token, then stream_idle_s of silence
    assert aborted == ["r1"]
    assert freed  # the admission queue was told the request's blocks are free


def test_a_prefill_past_its_deadline_falls_back_to_the_decode_worker():
    async def run():
        decode = ScriptedDecode()
        dserver, dport = await _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, decode)
        pserver, pport = await _serve(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, SilentPrefill())
        backend = _backend([_info("d1", "decode", dport), _info("p1", "prefill", pport)], prefill_id="p1",
                           timeouts=WorkerTimeouts(prefill_s=0.5, stream_idle_s=5.0))
        start = time.monotonic()
        tokens = await asyncio.wait_for(_tokens(backend, "r1"), 10)
        elapsed = time.monotonic() - start
        await backend.close()
        await dserver.stop(None)
        await pserver.stop(None)
        return tokens, elapsed, backend.transfers.prefill_retries, dict(backend.fallbacks)

    tokens, elapsed, retries, fallbacks = asyncio.run(run())
    assert tokens == TOKENS
    assert elapsed < 4.0
    assert (retries, fallbacks) == (1, {"prefill_failed": 1})


class _NoRoomWorker:
    worker_id = "d1"
    incarnation = "i1"

    def status(self) -> WorkerStatus:  # the servicer reads the numbers from here
        core = CoreStats(total_blocks=10, free_blocks=0, reserved_blocks=10, cached_blocks=0, num_running=3,
                         num_waiting=0, num_reserved=2, queued_prefill_tokens=0, num_preemptions=0,
                         prefix_cache_queries=0, prefix_cache_hits=0)
        return WorkerStatus("d1", "i1", "decode", WorkerState.SERVING, 16, 512, core, 5, TransferTotals())

    async def admit(self, *args, **kwargs):
        return None, asyncio.Queue()


def test_the_decode_worker_marks_its_no_room_refusal():
    async def run():
        server, port = await _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                                    DecodeWorkerServicer(_NoRoomWorker(), "here"))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(worker_pb2.DecodeRequest(request_id="r"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.read()
        await server.stop(None)
        return info.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (NO_ROOM_METADATA_KEY, "1") in tuple(error.trailing_metadata())
    assert error.details() == "decode worker d1 has no room now: 0 of 10 blocks free, 3 running"


def test_the_decode_worker_clamps_the_ticket_lifetime_a_caller_asks_for():
    assert [ticket_timeout_s(ms) for ms in (0, 5_000, 3_600_000)] == [60.0, 5.0, MAX_TICKET_TIMEOUT_S]
    assert MAX_TICKET_TIMEOUT_S == 120.0


def test_worker_timeouts_refuse_non_positive_deadlines():
    with pytest.raises(ValueError, match="stream_idle_s must be > 0; got 0"):
        WorkerTimeouts(stream_idle_s=0)
    assert isinstance(WorkerSilent("x"), WorkerFailure)
