"""The router's side of early first tokens (issue 16 item 4), against scripted in-process gRPC
workers (no model), over gRPC and over the worker link: the Prefill call runs while the router reads the Decode stream, and the
client gets the first token from whichever brings it first, exactly once (by position); a
prefill that fails after the stream brought the token changes nothing; an older decode worker
(no first token on its stream) still works. Each delta's sample times travel with it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from proto.link import LinkServer
from proto.link.methods import ABORT, DECODE, PREFILL
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.routing.admission import AdmissionQueue, AdmissionSettings
from router.routing.cluster_backend import ClusterBackend
from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.routing.policy import RouteDecision
from router.serving.backend import BackendRequest

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TOKENS = (7, 7, 9)  # a repeated token: a dedupe by value would lose one
SAMPLED = (1000.0, 1000.5, 1001.0)
NBYTES = 4096
SECRET = b"early-first-token-secret"
TRANSPORTS = pytest.mark.parametrize("link", [False, True], ids=["grpc", "link"])


class Decode(worker_pb2_grpc.DecodeWorkerServicer):
    """Tickets, then (when `early` and asked) streams TOKENS[0] once the KV is in, else waits
    for the Prefill reply and streams TOKENS[1:] (an older worker)."""

    def __init__(self, kv_in: asyncio.Event, replied: asyncio.Event, early: bool,
                 first_after_reply: bool = False, rest_before_reply: bool = False, expire: bool = False) -> None:
        self.kv_in, self.replied, self.early, self.expire = kv_in, replied, early, expire
        self.first_after_reply = first_after_reply
        self.rest_before_reply = rest_before_reply
        self.requests: list[worker_pb2.DecodeRequest] = []
        self.first_sent = asyncio.Event()

    async def Decode(self, request, context):
        self.requests.append(request)
        if request.local_prefill:  # the fallback: it prefills itself and streams every token
            yield worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(ticket_id=0, decode_worker_id="d1"))
            for k in range(len(TOKENS)):
                yield _chunk(k)
            return
        streams = self.early and request.stream_first_token
        yield worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(
            ticket_id=5, decode_worker_id="d1", num_cached_tokens=16, num_blocks=1,
            first_token_on_stream=streams))
        if self.expire:  # the ticket's deadline passed before the KV came: the worker ends it
            yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(finish_reason="abort", stop_token_id=-1))
            return
        await self.kv_in.wait()
        if streams:
            if self.first_after_reply:
                await self.replied.wait()
                await asyncio.sleep(0.05)
            yield _chunk(0)
            self.first_sent.set()
        if not self.rest_before_reply:
            await self.replied.wait()
        for k in (1, 2):
            yield _chunk(k)

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=True)


def _chunk(k: int) -> worker_pb2.DecodeEvent:
    return worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(
        token_ids=[TOKENS[k]], sampled_at=[SAMPLED[k]], stop_token_id=-1,
        finish_reason="length" if k == len(TOKENS) - 1 else ""))


class Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Pushes the KV (sets kv_in), then replies once `release` is set, or fails (UNAVAILABLE)."""

    def __init__(self, kv_in: asyncio.Event, replied: asyncio.Event, release: asyncio.Event,
                 fail: bool = False) -> None:
        self.kv_in, self.replied, self.release, self.fail = kv_in, replied, release, fail
        self.calls = 0

    async def Prefill(self, request, context):
        self.calls += 1
        self.kv_in.set()
        await self.release.wait()
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker went away")
        self.replied.set()
        return worker_pb2.PrefillResponse(
            first_token_id=TOKENS[0], num_cached_tokens=0,
            transfer=worker_pb2.TransferStats(bytes=NBYTES, seconds=0.002, num_blocks=1, backend="gloo"),
            timing=worker_pb2.PrefillTiming(queue_s=0.01, compute_s=0.02, first_token_at=SAMPLED[0]))

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=True)


def _info(worker_id: str, role: str, port: int, link_port: int | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{port}", metrics_address="",
                      link_address="" if link_port is None else f"127.0.0.1:{link_port}",
                      incarnation="i1", block_size=16, total_blocks=1000, free_blocks=1000, reserved_blocks=0,
                      cached_blocks=0, num_running=0, num_waiting=0, queued_prefill_tokens=0,
                      max_model_len=4096, updated_at=time.time())


class Cluster:
    """One decode double and two prefill doubles on real gRPC servers (and, with `link`, on
    worker links too, which the router's calls then take), and a ClusterBackend."""

    def __init__(self, early: bool = True, fail: bool = False, first_after_reply: bool = False,
                 rest_before_reply: bool = False, expire: bool = False, link: bool = False) -> None:
        self.link = link
        self.links: list[LinkServer] = []
        self.kv_in, self.replied, self.release = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.decode = Decode(self.kv_in, self.replied, early, first_after_reply, rest_before_reply, expire)
        self.prefill = Prefill(self.kv_in, self.replied, self.release, fail)
        self.spare = Prefill(asyncio.Event(), asyncio.Event(), self.release, fail)
        self.servers: list[grpc.aio.Server] = []

    async def start(self) -> ClusterBackend:
        d = await self._serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, self.decode)
        p1 = await self._serve(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.prefill)
        p2 = await self._serve(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, self.spare)
        links = [await self._link(self.decode, (DECODE, ABORT)), await self._link(self.prefill, (PREFILL, ABORT)),
                 await self._link(self.spare, (PREFILL, ABORT))] if self.link else [None] * 3
        snapshot = ClusterSnapshot(workers=(_info("d1", "decode", d, links[0]), _info("p1", "prefill", p1, links[1]),
                                            _info("p2", "prefill", p2, links[2])), taken_at=time.monotonic(), stale=False)

        async def snap():
            return snapshot

        def choose(route, snap, rng):
            return RouteDecision("p1", "d1", "scripted", (("score", 1.0),))

        self.backend = ClusterBackend(snap, choose, admission=AdmissionQueue(AdmissionSettings()),
                                      secret=SECRET if self.link else None)
        return self.backend

    async def _link(self, servicer, methods) -> int:
        server = LinkServer(SECRET, servicer, methods, "127.0.0.1", 0)
        self.links.append(server)
        return await server.start()

    async def _serve(self, add, servicer) -> int:
        server = grpc.aio.server()
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        return port

    async def stop(self) -> None:
        await self.backend.close()
        for server in self.servers:
            await server.stop(None)
        for link in self.links:
            await link.stop(1)


async def _deltas(stream, count: int | None = None):
    out = []
    async for delta in stream:
        out.append(delta)
        if count is not None and len(out) == count:
            break
    return out


def _request(params: SamplingParams = PARAMS) -> BackendRequest:
    return BackendRequest("r1", tuple(range(1, 33)), params)


@TRANSPORTS
def test_the_first_token_comes_from_the_decode_stream_before_the_prefill_reply_returns(link):
    async def run():
        cluster = Cluster(early=True, link=link)
        backend = await cluster.start()
        stream = backend.generate(_request())
        first = await asyncio.wait_for(anext(stream), 10)
        replied_before_first = cluster.replied.is_set()
        cluster.release.set()
        rest = await asyncio.wait_for(_deltas(stream), 10)
        await cluster.stop()
        return cluster, backend, first, rest, replied_before_first

    cluster, backend, first, rest, replied_before_first = asyncio.run(run())
    assert replied_before_first is False
    assert first.token_ids == (7,) and first.sampled_at == (1000.0,)
    assert first.route is not None and first.route.prefill_id == "p1"
    assert tuple(t for d in [first, *rest] for t in d.token_ids) == TOKENS
    # The double sets `replied` before its reply reaches the router, so the last chunk may come
    # while the reply is still out: then its token goes at once and the finish follows in a
    # delta of its own (split_final). Both orders are right; the tokens and times are the same.
    # (Over the link, chunks received behind one read are joined: join_queued.)
    assert [t for d in rest for t in d.sampled_at] == [1000.5, 1001.0]
    assert rest[-1].finish_reason == "length" and all(d.finish_reason is None for d in rest[:-1])
    assert cluster.decode.requests[0].stream_first_token is True
    trace = first.trace
    assert trace.prefill["first_token_from"] == "stream"
    assert (trace.transfer.nbytes, trace.transfer.num_blocks, trace.transfer.blocks_skipped) == (NBYTES, 1, 1)
    assert (backend.transfers.count, backend.transfers.nbytes, backend.transfers.prefill_retries) == (1, NBYTES, 0)
    assert list(trace.marks) == ["backend_start", "reserve_start", "ticket", "first_token"]


def test_the_last_token_reaches_the_client_before_the_prefill_reply_and_only_the_finish_waits_for_it():
    async def run():
        cluster = Cluster(early=True, rest_before_reply=True)
        backend = await cluster.start()
        stream = backend.generate(_request())
        before = await asyncio.wait_for(_deltas(stream, 3), 10)
        replied_before_last = cluster.replied.is_set()
        cluster.release.set()
        after = await asyncio.wait_for(_deltas(stream), 10)
        await cluster.stop()
        return before, replied_before_last, after

    before, replied_before_last, after = asyncio.run(run())
    assert replied_before_last is False
    assert [(d.token_ids, d.finish_reason, d.sampled_at) for d in before] == [
        ((7,), None, (1000.0,)), ((7,), None, (1000.5,)), ((9,), None, (1001.0,))]
    assert [(d.token_ids, d.finish_reason, d.sampled_at, d.route, d.trace) for d in after] == [
        ((), "length", (), None, None)]


@TRANSPORTS
def test_a_prefill_reply_first_is_streamed_once_and_the_streams_copy_is_dropped_by_position(link):
    async def run():
        cluster = Cluster(early=True, first_after_reply=True, link=link)
        backend = await cluster.start()
        cluster.release.set()
        deltas = await asyncio.wait_for(_deltas(backend.generate(_request())), 10)
        await cluster.stop()
        return cluster, deltas

    cluster, deltas = asyncio.run(run())
    assert cluster.decode.first_sent.is_set()  # the stream did send its copy of TOKENS[0]
    assert deltas[0].token_ids == (7,)  # the reply's, then the stream's from position 1 on
    assert [t for d in deltas for t in d.token_ids] == [7, 7, 9]  # (the link may join chunks)
    assert [t for d in deltas for t in d.sampled_at] == [1000.0, 1000.5, 1001.0]
    assert deltas[0].trace.prefill["first_token_from"] == "prefill_reply"


@TRANSPORTS
def test_a_prefill_failing_after_the_streams_first_token_is_harmless_and_tries_no_other_worker(link):
    async def run():
        cluster = Cluster(early=True, fail=True, link=link)
        backend = await cluster.start()
        stream = backend.generate(_request())
        first = await asyncio.wait_for(anext(stream), 10)
        cluster.release.set()  # the prefill now fails: its KV had arrived already
        await asyncio.sleep(0.2)
        cluster.replied.set()  # the decode worker goes on (it has the KV)
        rest = await asyncio.wait_for(_deltas(stream), 10)
        await cluster.stop()
        return cluster, backend, [first, *rest]

    cluster, backend, deltas = asyncio.run(run())
    assert tuple(t for d in deltas for t in d.token_ids) == TOKENS
    assert deltas[-1].finish_reason == "length"
    assert (cluster.prefill.calls, cluster.spare.calls) == (1, 0)
    assert (backend.transfers.prefill_retries, dict(backend.fallbacks)) == (0, {})
    assert deltas[0].trace.transfer is None  # no reply: no transfer numbers


def test_an_older_decode_worker_that_ignores_the_flag_gets_the_first_token_from_the_reply():
    async def run():
        cluster = Cluster(early=False)
        backend = await cluster.start()
        cluster.release.set()
        deltas = await asyncio.wait_for(_deltas(backend.generate(_request())), 10)
        await cluster.stop()
        return cluster, deltas

    cluster, deltas = asyncio.run(run())
    assert [d.token_ids for d in deltas] == [(7,), (7,), (9,)]
    assert cluster.decode.requests[0].stream_first_token is True
    assert deltas[0].trace.prefill["first_token_from"] == "prefill_reply"


def test_a_request_with_logprobs_does_not_ask_for_the_first_token_on_the_stream():
    async def run():
        cluster = Cluster(early=True)
        backend = await cluster.start()
        cluster.release.set()
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
        deltas = await asyncio.wait_for(_deltas(backend.generate(_request(params))), 10)
        await cluster.stop()
        return cluster, deltas

    cluster, deltas = asyncio.run(run())
    assert cluster.decode.requests[0].stream_first_token is False
    assert [d.token_ids for d in deltas] == [(7,), (7,), (9,)]


@TRANSPORTS
def test_a_client_leaving_while_the_prefill_runs_cancels_it_and_aborts_both_workers(link):
    async def run():
        cluster = Cluster(early=True, link=link)
        backend = await cluster.start()
        stream = backend.generate(_request())
        first = await asyncio.wait_for(anext(stream), 10)
        await stream.aclose()  # the client left; the Prefill reply is still held
        await cluster.stop()
        return backend, first

    backend, first = asyncio.run(run())
    assert first.token_ids == (7,)
    assert backend.transfers.count == 0
    assert backend._placements == {} and backend._prefill_tokens == {}


def test_every_prefill_failing_before_a_token_falls_back_to_the_decode_worker_and_the_trace_says_so():
    async def run():
        cluster = Cluster(early=False, fail=True)
        backend = await cluster.start()
        cluster.release.set()
        deltas = await asyncio.wait_for(_deltas(backend.generate(_request())), 10)
        await cluster.stop()
        return cluster, backend, deltas

    cluster, backend, deltas = asyncio.run(run())
    assert [d.token_ids for d in deltas] == [(7,), (7,), (9,)]
    assert (cluster.prefill.calls, cluster.spare.calls) == (1, 1)
    assert (backend.transfers.prefill_retries, dict(backend.fallbacks)) == (2, {"prefill_failed": 1})
    first = deltas[0]
    assert (first.path, first.route.fallback, first.route.prefill_id) == ("colocated", "prefill_failed", None)
    assert (first.trace.route.fallback, first.trace.route.prefill_id) == ("prefill_failed", None)
    assert list(first.trace.marks) == ["backend_start", "reserve_start", "ticket", "first_token"]


@TRANSPORTS
def test_a_ticket_the_decode_worker_expired_before_the_kv_came_falls_back_to_its_own_prefill(link):
    """The stream's tokenless "abort" (the ticket's deadline passed while the prefill was still
    queued) is no first token: the client once got a 200 stream with no token and finish_reason
    abort. Now the Prefill call is cancelled and the decode worker prefills the request itself."""
    async def run():
        cluster = Cluster(early=True, expire=True, link=link)  # the prefill never replies (release unset)
        backend = await cluster.start()
        deltas = await asyncio.wait_for(_deltas(backend.generate(_request())), 10)
        await cluster.stop()
        return cluster, backend, deltas

    cluster, backend, deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [7, 7, 9]  # (the link may join chunks)
    assert deltas[-1].finish_reason == "length"
    assert [r.local_prefill for r in cluster.decode.requests] == [False, True]
    assert dict(backend.fallbacks) == {"prefill_failed": 1}
    assert (deltas[0].path, deltas[0].route.fallback) == ("colocated", "prefill_failed")
