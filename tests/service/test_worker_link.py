"""The worker link over real TCP on 127.0.0.1 (proto/link): a worker's servicer serves the
router's calls with gRPC's semantics — responses in order, its abort() status with details and
trailing metadata, cancellation reaching the servicer's `finally`, every wait bounded — and no
caller gets anything without proving the cluster secret."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from proto.limits import NO_ROOM_METADATA_KEY
from proto.link import LinkChannel, LinkDecodeStub, LinkPrefillStub, LinkServer
from proto.link.methods import ABORT, DECODE, PREFILL
from proto.pdserve.v1 import common_pb2, worker_pb2
from router.routing.worker_calls import WorkerSilent, is_no_room, read_within, request_error

pytestmark = pytest.mark.timeout(60)
SECRET = b"link-service-secret"


class FakeWorker:
    """A servicer whose behaviour the request id picks; it records how each call ended."""

    def __init__(self) -> None:
        self.ended: dict[str, str] = {}
        self.started: set[str] = set()

    async def Decode(self, request, context):  # noqa: N802
        rid = request.request_id
        self.started.add(rid)
        if rid == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker d0 has no room now",
                                trailing_metadata=((NO_ROOM_METADATA_KEY, "1"),))
        if rid == "bug":
            raise RuntimeError("a bug in the servicer")
        yield worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(ticket_id=7, decode_worker_id="d0"))
        try:
            for i in range(request.sampling.max_tokens):
                if rid.startswith("hang"):
                    await asyncio.sleep(3600)
                last = i == request.sampling.max_tokens - 1
                yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(
                    token_ids=[100 + i], finish_reason="length" if last else "", stop_token_id=-1))
            self.ended[rid] = "finished"
        except (asyncio.CancelledError, GeneratorExit):  # cancelled mid-await, or closed at a yield
            self.ended[rid] = "cancelled"
            raise

    async def Prefill(self, request, context):  # noqa: N802
        if request.request_id.startswith("slow"):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.ended[request.request_id] = "cancelled"
                raise
        if request.request_id == "huge":
            return worker_pb2.PrefillResponse(first_token_id=1, transfer=worker_pb2.TransferStats(backend="x" * 5_000_000))
        return worker_pb2.PrefillResponse(first_token_id=len(request.prompt_token_ids))

    async def Abort(self, request, context):  # noqa: N802
        return worker_pb2.AbortResponse(aborted=request.request_id in self.started)


def decode_request(rid: str, max_tokens: int = 3, prompt=(1, 2, 3)) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=list(prompt),
                                    sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def read_all(call) -> list:
    events = []
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


async def started(methods=(DECODE, PREFILL, ABORT), **kwargs) -> tuple[LinkServer, FakeWorker, str]:
    worker = FakeWorker()
    server = LinkServer(SECRET, worker, methods, "127.0.0.1", 0, **kwargs)
    port = await server.start()
    return server, worker, f"127.0.0.1:{port}"


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_decode_stream_brings_the_ticket_then_every_token_then_eof():
    async def scenario():
        server, worker, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            events = await read_all(LinkDecodeStub(channel).Decode(decode_request("r1", 3)))
            assert [e.WhichOneof("event") for e in events] == ["ticket", "tokens", "tokens", "tokens"]
            assert events[0].ticket.ticket_id == 7
            assert [e.tokens.token_ids[0] for e in events[1:]] == [100, 101, 102]
            assert events[-1].tokens.finish_reason == "length"
            reply = await LinkPrefillStub(channel).Prefill(
                worker_pb2.PrefillRequest(request_id="p1", prompt_token_ids=[5, 6, 7, 8]), timeout=5)
            assert reply.first_token_id == 4
            assert (await LinkDecodeStub(channel).Abort(worker_pb2.AbortRequest(request_id="r1"), timeout=5)).aborted
        assert worker.ended == {"r1": "finished"}
        await server.stop(1)

    run(scenario)


def test_many_calls_of_mixed_lengths_share_one_connection_and_each_gets_its_own_tokens():
    async def scenario():
        server, _, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            stub = LinkDecodeStub(channel)
            lengths = [1 + (i * 7) % 23 for i in range(40)]
            results = await asyncio.gather(*(read_all(stub.Decode(decode_request(f"m{i}", n)))
                                             for i, n in enumerate(lengths)))
            for n, events in zip(lengths, results, strict=True):
                assert [e.tokens.token_ids[0] for e in events[1:]] == [100 + i for i in range(n)]
            assert channel.connects == 1
        await server.stop(1)

    run(scenario)


def test_a_servicer_abort_arrives_with_its_code_details_and_the_no_room_mark():
    async def scenario():
        server, _, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkDecodeStub(channel).Decode(decode_request("full")).read()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.details() == "decode worker d0 has no room now"
            assert is_no_room(caught.value)  # the router reads it as "wait for room", as over gRPC
        await server.stop(1)

    run(scenario)


def test_a_servicer_bug_ends_its_call_unknown_and_the_connection_serves_on(caplog):
    async def scenario():
        server, _, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            stub = LinkDecodeStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Decode(decode_request("bug")).read()
            assert caught.value.code() == grpc.StatusCode.UNKNOWN
            assert caught.value.details() == "Unexpected RuntimeError: a bug in the servicer"
            assert len(await read_all(stub.Decode(decode_request("after", 2)))) == 3
            assert channel.connects == 1
        await server.stop(1)

    with caplog.at_level("ERROR", logger="proto.link.server"):
        run(scenario)
    assert "link call Decode failed" in caplog.text


def test_a_cancelled_stream_cancels_the_servicer_and_reads_raise_cancelled():
    async def scenario():
        server, worker, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            call = LinkDecodeStub(channel).Decode(decode_request("hang-1", 5))
            assert (await call.read()).ticket.ticket_id == 7
            assert call.cancel() and not call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()
            for _ in range(200):
                if worker.ended.get("hang-1"):
                    break
                await asyncio.sleep(0.01)
            assert worker.ended == {"hang-1": "cancelled"}
            assert server.calls_in_flight == 0
        await server.stop(1)

    run(scenario)


def test_a_unary_call_past_its_deadline_fails_deadline_exceeded_and_is_cancelled_on_the_worker():
    async def scenario():
        server, worker, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkPrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="slow"), timeout=0.2)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(200):
                if worker.ended.get("slow"):
                    break
                await asyncio.sleep(0.01)
            assert worker.ended == {"slow": "cancelled"}
            # Again on the connection now open (the deadline is then a timer on the reply).
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkPrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="slow-2"), timeout=0.2)
            assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                                     "Deadline Exceeded")
            for _ in range(200):
                if worker.ended.get("slow-2"):
                    break
                await asyncio.sleep(0.01)
            assert worker.ended == {"slow": "cancelled", "slow-2": "cancelled"}
            assert channel.connects == 1
        await server.stop(1)

    run(scenario)


def test_a_worker_that_goes_away_ends_its_calls_unavailable_and_the_next_call_reconnects():
    async def scenario():
        server, worker, address = await started()
        port = int(address.rsplit(":", 1)[1])
        channel = LinkChannel(address, SECRET)
        call = LinkDecodeStub(channel).Decode(decode_request("hang-2", 5))
        await call.read()  # the ticket
        await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert worker.ended == {"hang-2": "cancelled"}
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # nobody listens now
            await LinkDecodeStub(channel).Decode(decode_request("r2")).read()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        again = LinkServer(SECRET, worker, (DECODE, PREFILL, ABORT), "127.0.0.1", port)
        await again.start()
        assert len(await read_all(LinkDecodeStub(channel).Decode(decode_request("r3", 2)))) == 3
        assert channel.connects == 2
        await channel.close()
        await again.stop(1)

    run(scenario)


def test_a_caller_with_another_secret_is_refused_before_any_call_runs():
    async def scenario():
        server, worker, address = await started()
        async with LinkChannel(address, b"not the cluster's") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkDecodeStub(channel).Decode(decode_request("r4")).read()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkPrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="p4"), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert worker.started == set() and server.refused == 2
        await server.stop(1)

    run(scenario)


def test_a_worker_that_does_not_prove_the_secret_is_not_trusted():
    """An impostor on the worker's address cannot take the router's prompts."""
    async def scenario():
        impostor, _, address = await started()
        impostor._secret = b"the impostor's"  # it answers the opening with a proof of its own secret
        async with LinkChannel(address, SECRET) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkDecodeStub(channel).Decode(decode_request("r5")).read()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await impostor.stop(1)

    run(scenario)


def test_a_connection_that_never_completes_the_opening_is_closed_at_the_deadline():
    async def scenario():
        server, _, address = await started(handshake_timeout_s=0.3)
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        hello = await reader.readexactly(72)
        assert hello.startswith(b"PDSLINK1")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a word
        assert server.refused == 1
        writer.close()
        await server.stop(1)

    run(scenario)


def test_a_port_that_is_not_a_link_fails_the_call_at_once_and_one_that_stays_silent_within_the_bound():
    async def scenario():
        async def http_like(reader, writer):
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" + b"x" * 40)
            await writer.drain()

        async def silent(reader, writer):
            await asyncio.sleep(30)

        for handler, code, seconds in ((http_like, "did not answer as a pdserve worker link", 5.0),
                                       (silent, "no link opening within 0.3 s", 0.3)):
            other = await asyncio.start_server(handler, "127.0.0.1", 0)
            address = f"127.0.0.1:{other.sockets[0].getsockname()[1]}"
            async with LinkChannel(address, SECRET, connect_timeout_s=seconds) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await LinkDecodeStub(channel).Decode(decode_request("r6")).read()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and code in caught.value.details()
            other.close()

    run(scenario)


def test_nothing_listening_fails_the_call_unavailable():
    async def scenario():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed again: nothing listens there
        async with LinkChannel(f"127.0.0.1:{port}", SECRET) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkPrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="p7"), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot connect" in caught.value.details()

    run(scenario)


def test_messages_up_to_the_limit_pass_and_larger_ones_fail_as_grpc_says_it():
    async def scenario():
        server, worker, address = await started(max_message_bytes=6_000_000)
        async with LinkChannel(address, SECRET, max_message_bytes=6_000_000) as channel:
            reply = await LinkPrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="huge"), timeout=10)
            assert len(reply.transfer.backend) == 5_000_000
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkDecodeStub(channel).Decode(decode_request("big", prompt=range(3_000_000))).read()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in caught.value.details()
            assert request_error(caught.value) is not None  # the router: the request's own fault (400)
        assert "big" not in worker.started
        await server.stop(1)

    run(scenario)


def test_a_method_the_worker_does_not_serve_is_unimplemented():
    async def scenario():
        server, _, address = await started(methods=(DECODE, ABORT))  # a decode worker: no Prefill
        async with LinkChannel(address, SECRET) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await LinkPrefillStub(channel).Prefill(worker_pb2.PrefillRequest(request_id="p8"), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        await server.stop(1)

    run(scenario)


def test_stop_lets_calls_in_flight_finish_within_the_grace_then_cancels_the_rest():
    async def scenario():
        server, worker, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            stub = LinkDecodeStub(channel)
            hanging = stub.Decode(decode_request("hang-3", 5))
            await hanging.read()
            finishing = asyncio.ensure_future(read_all(stub.Decode(decode_request("quick", 2))))
            await asyncio.sleep(0)
            await server.stop(0.3)
            assert len(await finishing) == 3
            with pytest.raises(grpc.aio.AioRpcError):
                await hanging.read()
        assert worker.ended == {"quick": "finished", "hang-3": "cancelled"}

    run(scenario)


def test_a_caller_that_stops_reading_is_taken_for_gone_and_its_calls_are_cancelled():
    """Every wait has a bound: a worker does not hold a stream open for a caller that takes nothing."""
    async def scenario():
        server, worker, address = await started(write_stall_s=0.5)
        host, port = address.rsplit(":", 1)
        from proto.link import handshake
        from proto.link.frames import FrameKind, frame

        reader, writer = await asyncio.open_connection(host, int(port))
        writer.transport.set_write_buffer_limits(0)
        hello = await reader.readexactly(handshake.HELLO_BYTES)
        proof, _ = handshake.proof_for(SECRET, handshake.nonce_of_hello(hello))
        writer.write(proof + frame(1, FrameKind.CALL, bytes((DECODE.id,)) + decode_request("flood", 10**6).SerializeToString()))
        await writer.drain()
        writer.transport.pause_reading()  # takes nothing more: the worker's buffers fill, then it waits
        for _ in range(500):
            if worker.ended.get("flood"):
                break
            await asyncio.sleep(0.02)
        assert worker.ended == {"flood": "cancelled"} and server.calls_in_flight == 0
        writer.close()
        await server.stop(1)

    run(scenario)


def test_read_nowait_hands_out_what_has_arrived_and_never_the_end():
    async def scenario():
        server, _, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            call = LinkDecodeStub(channel).Decode(decode_request("r9", 3))
            assert call.read_nowait() is None  # nothing yet: not even sent
            assert (await call.read()).ticket.ticket_id == 7
            for _ in range(200):  # the worker sends the tokens right behind the ticket
                if call.done():
                    break
                await asyncio.sleep(0.01)
            assert [call.read_nowait().tokens.token_ids[0] for _ in range(3)] == [100, 101, 102]
            assert call.read_nowait() is None
            assert await call.read() is grpc.aio.EOF
        await server.stop(1)

    run(scenario)


def test_read_within_hands_out_what_has_arrived_and_bounds_the_wait_for_the_rest():
    async def scenario():
        server, worker, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            call = LinkDecodeStub(channel).Decode(decode_request("r10", 2))
            assert (await read_within(call, 5, "decode")).ticket.ticket_id == 7
            for _ in range(200):
                if call.done():
                    break
                await asyncio.sleep(0.01)
            assert [(await read_within(call, 5, "decode")).tokens.token_ids[0] for _ in range(2)] == [100, 101]
            assert await read_within(call, 5, "decode") is grpc.aio.EOF
            hung = LinkDecodeStub(channel).Decode(decode_request("hang1", 2))
            assert (await read_within(hung, 5, "decode")).ticket.ticket_id == 7
            with pytest.raises(WorkerSilent, match="decode sent nothing for 0.2 s"):
                await read_within(hung, 0.2, "decode")
            assert hung.done()  # cancelled at the deadline
            for _ in range(200):
                if worker.ended.get("hang1"):
                    break
                await asyncio.sleep(0.01)
            assert worker.ended["hang1"] == "cancelled"
        await server.stop(1)

    run(scenario)


def test_a_bounded_read_times_out_without_ending_the_call_and_an_unbounded_one_still_gets_the_end():
    async def scenario():
        server, _, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            hung = LinkDecodeStub(channel).Decode(decode_request("hang2", 2))
            assert (await hung.read(5)).ticket.ticket_id == 7
            with pytest.raises(TimeoutError):
                await hung.read(0.05)
            assert not hung.done()  # the caller decides: read_within cancels it
            assert hung.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hung.read(5)
            call = LinkDecodeStub(channel).Decode(decode_request("r11", 1))
            assert [e.WhichOneof("event") for e in [await call.read(5), await call.read(5)]] == ["ticket", "tokens"]
            assert await call.read() is grpc.aio.EOF
        await server.stop(1)

    run(scenario)


def test_arrival_is_done_once_a_read_would_not_wait_and_a_read_after_it_takes_over():
    async def scenario():
        server, _, address = await started()
        async with LinkChannel(address, SECRET) as channel:
            call = LinkDecodeStub(channel).Decode(decode_request("r12", 2))
            arrived = call.arrival()
            assert not arrived.done()  # nothing received yet
            await asyncio.wait_for(arrived, 5)
            assert (await call.read()).ticket.ticket_id == 7  # without waiting
            for _ in range(200):
                if call.done():
                    break
                await asyncio.sleep(0.01)
            assert call.arrival().done()  # tokens queued: done at once
            assert [(await call.read()).tokens.token_ids[0] for _ in range(2)] == [100, 101]
            assert call.arrival().done()  # the end: a read returns it without waiting
            assert await call.read() is grpc.aio.EOF
            hung = LinkDecodeStub(channel).Decode(decode_request("hang3", 2))
            assert (await hung.read(5)).ticket.ticket_id == 7
            stale = hung.arrival()
            with pytest.raises(TimeoutError):  # a read takes the wait over from the arrival
                await hung.read(0.05)
            assert not stale.done()
            assert hung.cancel()
        await server.stop(1)

    run(scenario)
