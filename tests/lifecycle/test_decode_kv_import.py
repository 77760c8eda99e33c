"""The decode worker's import thread (decode_worker.kv_import) and early first tokens, on the
real DecodeWorker and PrefillWorker with the tiny model over the in-process `local` backend:
KV lands in the reserved blocks without the engine loop, an abort during the write waits for it
and then frees every block, and a stream_first_token request streams the prefill's first token
before the Prefill call returns. Each test ends with no record left and no block held."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch

from decode_worker.servicer import DecodeWorkerServicer
from decode_worker.worker import DecodeState
from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from kv_transfer.local import LocalBackend
from kv_transfer.packing import make_header, pack_blocks, unpack_blocks
from prefill_worker.worker import DecodeTarget
from proto.convert import params_to_proto
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.lifecycle.pd_pair import assert_idle, loop_held, make_pair, prompt, record_of
from tests.tiny_model import tiny_llm

S = DecodeState
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
P = prompt(40, 7)  # 3 blocks of 16


@pytest.fixture()
def pair(tiny_model_dir):
    p = make_pair(tiny_model_dir)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return list(tiny_llm(tiny_model_dir).generate([list(P)], PARAMS)[0].token_ids)


def _idle(pair) -> None:
    assert_idle(pair.decode)
    assert_idle(pair.prefill)
    assert pair.decode.importer.open_landings == 0


def _payload(pair, blocks: int, seed: int = 0) -> torch.Tensor:
    """Random KV of the decode cache's shape for `blocks` blocks."""
    like = pack_blocks(pair.decode.core.kv_caches, list(range(blocks)))
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)


async def _rest(outputs) -> list:
    items = []
    while not items or items[-1].finish_reason is None:
        items.append(await asyncio.wait_for(outputs.get(), 30))
    return items


def test_arriving_kv_lands_in_the_reserved_blocks_while_the_engine_loop_is_held(pair):
    payload = _payload(pair, 3)

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        record = record_of(pair.decode, "r")
        with loop_held(pair.decode):  # the engine loop runs nothing until the block ends
            sender = pair.backend.connect(pair.receiver.open_channel())
            sender.send(make_header(ticket.ticket_id, 77, payload), payload)
            landed = await asyncio.to_thread(wait_until, lambda: torch.equal(
                pack_blocks(pair.decode.core.kv_caches, record.block_ids), payload), 10)
            state_while_held = record.state
        items = await _rest(outputs)
        return landed, state_while_held, record, items

    landed, state_while_held, record, items = asyncio.run(run())
    assert (landed, state_while_held) == (True, S.TICKETED)  # written; committed only by the loop
    assert record.history == [S.TICKETED, S.DECODING, S.FINISHED]
    assert sum(len(i.new_token_ids) for i in items) == PARAMS.max_tokens - 1  # 77 was the first
    _idle(pair)


def test_an_abort_during_the_kv_write_waits_for_the_write_then_frees_every_block(pair):
    writing, go = threading.Event(), threading.Event()

    def gated_unpack(payload, caches, block_ids):
        writing.set()
        assert go.wait(30), "the test never released the write"
        unpack_blocks(payload, caches, block_ids)

    pair.decode.importer._unpack = gated_unpack
    payload = _payload(pair, 3, seed=1)

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        record = record_of(pair.decode, "r")
        sender = pair.backend.connect(pair.receiver.open_channel())
        sender.send(make_header(ticket.ticket_id, 77, payload), payload)
        assert await asyncio.to_thread(writing.wait, 10)
        aborting = asyncio.create_task(pair.decode.abort("r"))
        await asyncio.sleep(0.3)
        waited = not aborting.done()
        blocks_free_during_write = pair.decode.core.kv.num_free_blocks
        go.set()
        aborted = await asyncio.wait_for(aborting, 10)
        return waited, blocks_free_during_write, aborted, record, await _rest(outputs)

    waited, free_during, aborted, record, items = asyncio.run(run())
    total = pair.decode.core.kv.num_blocks
    assert (waited, free_during, aborted) == (True, total - 3, True)
    assert record.history == [S.TICKETED, S.ABORTED]
    assert [(i.new_token_ids, i.finish_reason) for i in items] == [((), "abort")]
    _idle(pair)


def test_a_stream_first_token_request_streams_the_first_token_before_the_prefill_returns(pair, offline):
    async def run():
        started = time.time()
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0, stream_first_token=True)
        pair.pool.held = True  # the prefill's transfer result waits: its reply cannot come back
        prefill = asyncio.create_task(pair.prefill.prefill("r", P, PARAMS, pair.target(ticket)))
        first = await asyncio.wait_for(outputs.get(), 30)
        prefill_done_at_first = prefill.done()
        pair.pool.held = False
        reply = await asyncio.wait_for(prefill, 30)
        return started, first, prefill_done_at_first, reply, await _rest(outputs), time.time()

    started, first, prefill_done, reply, rest, ended = asyncio.run(run())
    assert (first.new_token_ids, first.finish_reason, prefill_done) == ((offline[0],), None, False)
    assert reply.first_token_id == offline[0]
    assert [t for i in rest for t in i.new_token_ids] == offline[1:]
    stamps = [first.sampled_at] + [i.sampled_at for i in rest]
    assert all(started < s < ended for s in stamps), (started, stamps, ended)
    assert stamps == sorted(stamps)
    _idle(pair)


def test_the_first_token_streams_as_its_payload_lands_while_the_engine_loop_is_held(pair):
    payload = _payload(pair, 3, seed=2)

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0, stream_first_token=True)
        record = record_of(pair.decode, "r")
        with loop_held(pair.decode):  # no step boundary, no commit until the block ends
            sender = pair.backend.connect(pair.receiver.open_channel())
            sender.send(make_header(ticket.ticket_id, 77, payload, first_token_at=1234.5), payload)
            first = await asyncio.wait_for(outputs.get(), 10)
            state_while_held = record.state
        return first, state_while_held, record, await _rest(outputs)

    first, state_while_held, record, rest = asyncio.run(run())
    assert (first.new_token_ids, first.finish_reason, first.sampled_at, state_while_held) == (
        (77,), None, 1234.5, S.TICKETED)
    assert sum(len(i.new_token_ids) for i in rest) == PARAMS.max_tokens - 1  # 77 is not sent twice
    assert record.history == [S.TICKETED, S.DECODING, S.FINISHED]
    _idle(pair)


def test_the_first_token_streams_from_the_receiving_thread_while_the_import_thread_is_busy(pair):
    polled, go = threading.Event(), threading.Event()
    real_import = pair.decode.importer._import

    def stalled_import(received):  # the import thread took the payload and gets no further
        polled.set()
        assert go.wait(30), "the test never released the import"
        return real_import(received)

    pair.decode.importer._import = stalled_import
    payload = _payload(pair, 3, seed=4)

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0, stream_first_token=True)
        sender = pair.backend.connect(pair.receiver.open_channel())
        sender.send(make_header(ticket.ticket_id, 77, payload, first_token_at=1234.5), payload)
        first = await asyncio.wait_for(outputs.get(), 10)
        stalled = await asyncio.to_thread(polled.wait, 10) and not go.is_set()
        go.set()
        return first, stalled, await _rest(outputs)

    first, stalled, rest = asyncio.run(run())
    assert (first.new_token_ids, first.sampled_at, stalled) == ((77,), 1234.5, True)
    assert sum(len(i.new_token_ids) for i in rest) == PARAMS.max_tokens - 1  # 77 is not sent twice
    _idle(pair)


def test_a_landed_hook_that_raises_is_logged_and_the_payload_is_still_polled(caplog):
    backend = LocalBackend()
    receiver = backend.open_receiver()
    seen = []

    def broken(header):
        seen.append(header.ticket_id)
        raise RuntimeError("hook broke")

    receiver.on_landed(broken)
    payload = torch.zeros(2, 2, 1, 16, 1, 8)
    backend.connect(receiver.open_channel()).send(make_header(5, 77, payload), payload)
    assert wait_until(lambda: bool(seen), 10)
    [received] = receiver.poll()
    assert (seen, received.header.ticket_id, received.payload is not None) == ([5], 5, True)
    assert "the landed hook failed for ticket 5" in caplog.text


def test_a_first_token_that_is_a_stop_token_waits_for_the_loop_and_streams_with_its_finish(pair):
    stop_at_77 = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[77])
    payload = _payload(pair, 3, seed=3)

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, stop_at_77, 60.0, stream_first_token=True)
        sender = pair.backend.connect(pair.receiver.open_channel())
        sender.send(make_header(ticket.ticket_id, 77, payload), payload)
        return await _rest(outputs)

    items = asyncio.run(run())
    assert [(i.new_token_ids, i.finish_reason, i.stop_reason) for i in items] == [((77,), "stop", 77)]
    _idle(pair)


def test_without_stream_first_token_the_stream_starts_at_the_second_token(pair, offline):
    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        reply = await pair.prefill.prefill("r", P, PARAMS, pair.target(ticket))
        return reply, await _rest(outputs)

    reply, items = asyncio.run(run())
    assert reply.first_token_id == offline[0]
    assert [i.new_token_ids for i in items] == [(t,) for t in offline[1:]]
    assert all(i.sampled_at is not None for i in items)
    _idle(pair)


def test_a_first_token_that_ends_the_request_streams_with_its_finish(pair, offline):
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, one, 60.0, stream_first_token=True)
        await pair.prefill.prefill("r", P, one, pair.target(ticket))
        return await _rest(outputs)

    items = asyncio.run(run())
    assert [(i.new_token_ids, i.finish_reason) for i in items] == [((offline[0],), "length")]
    _idle(pair)


def _decode_call(stub, flag: bool):
    return stub.Decode(worker_pb2.DecodeRequest(
        request_id="r", prompt_token_ids=list(P), sampling=params_to_proto(PARAMS), stream_first_token=flag))


async def _grpc_events(pair, flag: bool):
    """Over the real servicer: the events of one Decode call, and whether the Prefill call had
    returned when the first token event arrived (its transfer result is held until then)."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(pair.decode, "here"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = _decode_call(worker_pb2_grpc.DecodeWorkerStub(channel), flag)
            t = (await asyncio.wait_for(call.read(), 30)).ticket
            pair.pool.held = True
            target = DecodeTarget("here", pair.decode.incarnation, t.ticket_id, t.num_cached_tokens, t.num_blocks)
            prefill = asyncio.create_task(pair.prefill.prefill("r", P, PARAMS, target))
            if not flag:  # nothing is streamed before the reply: let the prefill end first
                pair.pool.held = False
                await asyncio.wait_for(asyncio.shield(prefill), 30)
            events = [await asyncio.wait_for(call.read(), 30)]
            prefill_done = prefill.done()
            pair.pool.held = False
            while not events[-1].tokens.finish_reason:
                events.append(await asyncio.wait_for(call.read(), 30))
            reply = await asyncio.wait_for(prefill, 30)
    finally:
        await server.stop(None)
    return events, prefill_done, reply


@pytest.mark.parametrize("flag", [True, False])
def test_over_grpc_the_first_event_after_the_ticket_is_the_first_token_only_with_the_flag(pair, offline, flag):
    events, prefill_done, reply = asyncio.run(_grpc_events(pair, flag))
    tokens = [list(e.tokens.token_ids) for e in events]
    assert reply.first_token_id == offline[0]
    if flag:
        assert (tokens, prefill_done) == ([[t] for t in offline], False)
    else:
        assert (tokens, prefill_done) == ([[t] for t in offline[1:]], True)
    assert [len(e.tokens.sampled_at) for e in events] == [1] * len(events)
    assert [e.tokens.finish_reason for e in events][-1] == "length"
    _idle(pair)
