"""Draining the real workers (tiny model, `local` transfers): a drain refuses new work, lets
what is in flight finish with the same tokens as an undrained run, and past its timeout ends
the rest with an explicit error (an UNAVAILABLE gRPC status, never a silent finish) and frees
every block. A prefill worker's drain never returns while a transfer it owes is on the wire."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from decode_worker.servicer import DecodeWorkerServicer
from decode_worker.worker import DecodeDraining, DecodeState
from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from prefill_worker.servicer import PrefillWorkerServicer
from prefill_worker.worker import (
    DecodeTarget, PrefillDrained, PrefillDraining, PrefillResult, PrefillState, TransferFailed,
)
from proto.convert import params_to_proto
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.lifecycle.pd_pair import (
    assert_idle, loop_held, loop_held_when, make_pair, prompt, record_of,
)
from tests.tiny_model import tiny_llm
from worker_runtime.status import DrainResult, WorkerState

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
A, B = prompt(40, 5), prompt(24, 6)
LONG = prompt(200, 7)


@pytest.fixture()
def pair(tiny_model_dir):
    p = make_pair(tiny_model_dir, max_num_batched_tokens=32, transfer_timeout_s=0.2)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    outputs = tiny_llm(tiny_model_dir).generate([list(A), list(B)], PARAMS)
    return {A: list(outputs[0].token_ids), B: list(outputs[1].token_ids)}


async def _stream(outputs) -> list[int]:
    tokens = []
    while True:
        item = await asyncio.wait_for(outputs.get(), 30)
        tokens += item.new_token_ids
        if item.finish_reason is not None:
            return tokens


def _idle(pair) -> None:
    assert_idle(pair.decode)
    assert_idle(pair.prefill)


def _outcome(results: list) -> list:
    return [type(r).__name__ if isinstance(r, BaseException) else r for r in results]


# ------------------------------------------------------------------ decode


def test_a_decode_drain_lets_ticketed_and_decoding_requests_finish_with_undrained_tokens(pair, offline):
    async def run():
        two = lambda: pair.decode.in_flight == 2  # noqa: E731
        with loop_held_when(pair.decode, two) as held:
            ticket, a_out = await pair.decode.admit("a", A, PARAMS, 60.0)
            _, b_out = await pair.decode.admit("b", B, PARAMS, 60.0, local_prefill=True)
            assert await asyncio.to_thread(held.wait, 10)
            draining = asyncio.create_task(pair.decode.drain(30.0))
            await asyncio.sleep(0.05)
            status = pair.decode.status()
            assert (status.state, status.in_flight) == (WorkerState.DRAINING, 2)
            with pytest.raises(DecodeDraining, match="^decode worker decode-t is draining: it takes no new requests$"):
                await pair.decode.admit("c", A, PARAMS, 60.0)
        first = await pair.prefill.prefill("a", A, PARAMS, pair.target(ticket))  # fills the TICKETED one
        a_tokens = [first.first_token_id] + await _stream(a_out)
        return a_tokens, await _stream(b_out), await asyncio.wait_for(draining, 30)

    a_tokens, b_tokens, result = asyncio.run(run())
    assert (a_tokens, b_tokens) == (offline[A], offline[B])
    assert (result.finished, result.aborted) == (2, 0)
    assert pair.decode.begin_drain() is False  # idempotent
    _idle(pair)


async def _serve(add, servicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _decode_request(request_id: str, p, local: bool) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=list(p), sampling=params_to_proto(
        SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)), local_prefill=local)


async def _read_until_error(stream) -> grpc.aio.AioRpcError | None:
    try:
        while await asyncio.wait_for(stream.read(), 30) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


def test_a_decode_drain_past_its_timeout_ends_each_stream_with_unavailable_and_frees_blocks(pair):
    async def run():
        server, port = await _serve(worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                                    DecodeWorkerServicer(pair.decode, "here"))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            with loop_held_when(pair.decode, lambda: pair.decode.in_flight == 2) as held:
                ticketed = stub.Decode(_decode_request("a", A, local=False))
                assert (await ticketed.read()).ticket.num_blocks == 3
                decoding = stub.Decode(_decode_request("b", B, local=True))
                assert (await decoding.read()).ticket.ticket_id == 0
                assert await asyncio.to_thread(held.wait, 10)
                records = {r.request_id: r for r in pair.decode.records()}
                draining = asyncio.create_task(pair.decode.drain(0.3))
                await asyncio.sleep(0.6)  # the drain times out; its cut waits behind the held loop
                refused = await _read_until_error(stub.Decode(_decode_request("c", A, local=True)))
                load = await stub.GetLoad(worker_pb2.LoadRequest())
            errors = [await _read_until_error(s) for s in (ticketed, decoding)]
        await server.stop(None)
        return records, refused, load, errors, await asyncio.wait_for(draining, 10)

    records, refused, load, errors, result = asyncio.run(run())
    assert {rid: r.history for rid, r in records.items()} == {
        "a": [DecodeState.TICKETED, DecodeState.FAILED], "b": [DecodeState.DECODING, DecodeState.FAILED]}
    assert (refused.code(), refused.details()) == (
        grpc.StatusCode.UNAVAILABLE, "decode worker decode-t is draining: it takes no new requests")
    assert (load.state, load.in_flight, load.role) == ("draining", 2, "decode")
    assert [(e.code(), e.details()) for e in errors] == [
        (grpc.StatusCode.UNAVAILABLE,
         "decode worker decode-t drained: request a (TICKETED) ended after the 0.3 s drain timeout"),
        (grpc.StatusCode.UNAVAILABLE,
         "decode worker decode-t drained: request b (DECODING) ended after the 0.3 s drain timeout"),
    ]
    assert (result.finished, result.aborted) == (0, 2)
    _idle(pair)


def test_the_drain_rpc_calls_the_process_hook_or_answers_unimplemented(pair):
    calls = []

    def hook(timeout_s):
        calls.append(timeout_s)
        return len(calls) == 1, 3

    async def run():
        replies = []
        for servicer in (DecodeWorkerServicer(pair.decode, "here", request_drain=hook),
                         PrefillWorkerServicer(pair.prefill, request_drain=hook),
                         DecodeWorkerServicer(pair.decode, "here")):
            add = (worker_pb2_grpc.add_PrefillWorkerServicer_to_server if isinstance(servicer, PrefillWorkerServicer)
                   else worker_pb2_grpc.add_DecodeWorkerServicer_to_server)
            stub_type = (worker_pb2_grpc.PrefillWorkerStub if isinstance(servicer, PrefillWorkerServicer)
                         else worker_pb2_grpc.DecodeWorkerStub)
            server, port = await _serve(add, servicer)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = stub_type(channel)
                try:
                    reply = await stub.Drain(worker_pb2.DrainRequest(timeout_ms=1500) if not replies
                                             else worker_pb2.DrainRequest())
                    replies.append((reply.started, reply.in_flight))
                except grpc.aio.AioRpcError as exc:
                    replies.append((exc.code(), exc.details()))
            await server.stop(None)
        return replies

    assert asyncio.run(run()) == [
        (True, 3), (False, 3),
        (grpc.StatusCode.UNIMPLEMENTED, "this worker was started without a drain hook (it is not a worker process)"),
    ]
    assert calls == [1.5, None]
    assert pair.decode.status().state is WorkerState.SERVING  # the hook, not the servicer, drains


# ----------------------------------------------------------------- prefill


def test_a_prefill_drain_lets_queued_prefills_finish_and_refuses_new_ones(pair, offline):
    async def run():
        ta, a_out = await pair.decode.admit("a", A, PARAMS, 60.0)
        tb, b_out = await pair.decode.admit("b", B, PARAMS, 60.0)
        with loop_held(pair.prefill):
            tasks = [asyncio.create_task(pair.prefill.prefill(r, p, PARAMS, pair.target(t)))
                     for r, p, t in (("a", A, ta), ("b", B, tb))]
            await asyncio.to_thread(wait_until, lambda: pair.prefill.in_flight == 2, 10)
            draining = asyncio.create_task(pair.prefill.drain(30.0))
            await asyncio.sleep(0.05)
            with pytest.raises(PrefillDraining, match="^prefill worker prefill-t is draining: it takes no new requests$"):
                await pair.prefill.prefill("c", A, PARAMS, DecodeTarget("decode:1", "i", 9, 0, 3))
        firsts = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        tokens = [[f.first_token_id] + await _stream(o) for f, o in zip(firsts, (a_out, b_out))]
        return tokens, await asyncio.wait_for(draining, 30)

    tokens, result = asyncio.run(run())
    assert tokens == [offline[A], offline[B]]
    assert (result.finished, result.aborted) == (2, 0)
    assert pair.prefill.status().state is WorkerState.DRAINING
    _idle(pair)


def test_a_prefill_drain_waits_past_its_timeout_for_a_transfer_on_the_wire(pair):
    pair.pool.held = True

    async def run():
        task = asyncio.create_task(pair.prefill.prefill("s", B, PARAMS, DecodeTarget("decode:1", "i", 11, 0, 2)))
        record = await asyncio.to_thread(record_of, pair.prefill, "s")
        await asyncio.to_thread(wait_until, lambda: record.state is PrefillState.SENDING, 10)
        started = time.monotonic()
        draining = asyncio.create_task(pair.prefill.drain(0.1))
        await asyncio.sleep(1.0)  # past the drain's timeout, within the transport's bound (1.6 s)
        still_waiting = not draining.done()
        pair.pool.held = False
        result = await asyncio.wait_for(draining, 10)
        return still_waiting, record, await task, result, time.monotonic() - started

    still_waiting, record, sent, result, seconds = asyncio.run(run())
    assert still_waiting
    assert record.history[-2:] == [PrefillState.SENDING, PrefillState.SENT]
    assert isinstance(sent, PrefillResult) and sent.num_blocks == 2
    assert (result.finished, result.aborted) == (1, 0)
    assert 1.0 <= seconds < 1.6 + 5.0  # generous: the machine is shared
    _idle(pair)


def test_a_prefill_drain_past_its_timeout_fails_every_state_and_frees_blocks(pair):
    """One request in each non-terminal state when the 0.3 s drain times out: CONNECTING,
    QUEUED and COMPUTING fail at once; the SENDING one after the transport's bound."""
    S = PrefillState

    def target(ticket: int, blocks: int, address: str = "decode:1") -> DecodeTarget:
        return DecodeTarget(address, "i", ticket, 0, blocks)

    async def run():
        pair.pool.held = True
        tasks = {"s": asyncio.create_task(pair.prefill.prefill("s", B, PARAMS, target(1, 2)))}
        records = {"s": await asyncio.to_thread(record_of, pair.prefill, "s")}
        await asyncio.to_thread(wait_until, lambda: records["s"].state is S.SENDING, 10)
        computing = lambda: any(r.state is S.COMPUTING for r in pair.prefill.records())  # noqa: E731
        with loop_held_when(pair.prefill, computing) as held:
            tasks["m"] = asyncio.create_task(pair.prefill.prefill("m", LONG, PARAMS, target(2, 13)))
            assert await asyncio.to_thread(held.wait, 10)
            tasks["q"] = asyncio.create_task(pair.prefill.prefill("q", A, PARAMS, target(3, 3)))
            pair.opener.hold = True  # a new decode address: a new channel, held opening
            tasks["c"] = asyncio.create_task(pair.prefill.prefill("c", A, PARAMS, target(4, 3, "decode:2")))
            for rid in ("m", "q", "c"):
                records[rid] = await asyncio.to_thread(record_of, pair.prefill, rid)
            await asyncio.to_thread(wait_until, lambda: records["q"].state is S.QUEUED, 10)
            before = {rid: r.state for rid, r in records.items()}
            draining = asyncio.create_task(pair.prefill.drain(0.3))
            await asyncio.sleep(0.6)
        result = await asyncio.wait_for(draining, 30)
        outcomes = {rid: (await asyncio.gather(t, return_exceptions=True))[0] for rid, t in tasks.items()}
        pair.opener.go.set()
        return before, records, outcomes, result

    before, records, outcomes, result = asyncio.run(run())
    assert before == {"s": S.SENDING, "m": S.COMPUTING, "q": S.QUEUED, "c": S.CONNECTING}
    assert {rid: r.history[-1] for rid, r in records.items()} == dict.fromkeys("smqc", S.FAILED)
    for rid, state in (("c", "CONNECTING"), ("q", "QUEUED"), ("m", "COMPUTING")):
        assert isinstance(outcomes[rid], PrefillDrained)
        assert str(outcomes[rid]) == (f"prefill worker prefill-t drained: request {rid} ({state}) ended after "
                                      "the 0.3 s drain timeout")
    assert isinstance(outcomes["s"], TransferFailed) and str(outcomes["s"]) == "ticket 1 unsent after 1.6 s"
    assert (result.finished, result.aborted) == (0, 4)
    pair.pool.held = False
    _idle(pair)


def test_prefill_calls_during_and_past_a_drain_fail_unavailable_over_grpc(pair):
    async def run():
        server, port = await _serve(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, PrefillWorkerServicer(pair.prefill))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            pair.opener.hold = True
            request = worker_pb2.PrefillRequest(
                request_id="c", prompt_token_ids=list(A), sampling=params_to_proto(PARAMS),
                ticket=worker_pb2.Ticket(ticket_id=4, decode_address="decode:1", num_blocks=3, incarnation="i"))
            held = asyncio.ensure_future(stub.Prefill(request))
            await asyncio.to_thread(record_of, pair.prefill, "c")
            draining = asyncio.create_task(pair.prefill.drain(0.2))
            errors = []
            for call in (stub.Prefill(request), held):
                try:
                    await asyncio.wait_for(call, 10)
                except grpc.aio.AioRpcError as exc:
                    errors.append((exc.code(), exc.details()))
            load = await stub.GetLoad(worker_pb2.LoadRequest())
        await server.stop(None)
        pair.opener.go.set()
        return errors, load, await draining

    errors, load, result = asyncio.run(run())
    assert errors == [
        (grpc.StatusCode.UNAVAILABLE, "prefill worker prefill-t is draining: it takes no new requests"),
        (grpc.StatusCode.UNAVAILABLE,
         "prefill worker prefill-t drained: request c (CONNECTING) ended after the 0.2 s drain timeout"),
    ]
    assert (load.role, load.state, load.in_flight) == ("prefill", "draining", 0)
    assert result == DrainResult(finished=0, aborted=1, seconds=result.seconds)
    _idle(pair)

