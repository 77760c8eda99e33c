"""The real DecodeWorker's named states (decode_worker.states), driven through every
transition with the tiny model; tickets are filled by the real PrefillWorker over the
in-process `local` backend. Each test ends with no record left and no block held, reserved
or used. (The drain's transitions are in test_worker_drain.py.)"""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.states import TERMINAL, TRANSITIONS, DecodeRecord, move
from decode_worker.worker import DecodeState
from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from kv_transfer.base import ReceivedKV, TransferResult, TransferState
from kv_transfer.packing import make_header, pack_blocks
from tests.lifecycle.pd_pair import assert_idle, loop_held_when, make_pair, prompt, record_of
from tests.tiny_model import tiny_llm
from worker_runtime.status import Worker

S = DecodeState
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
P = prompt(40, 4)  # 3 blocks


@pytest.fixture()
def pair(tiny_model_dir):
    p = make_pair(tiny_model_dir)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return list(tiny_llm(tiny_model_dir).generate([list(P)], PARAMS)[0].token_ids)


async def _stream(outputs) -> tuple[list[int], str]:
    tokens = []
    while True:
        item = await asyncio.wait_for(outputs.get(), 30)
        tokens += item.new_token_ids
        if item.finish_reason is not None:
            return tokens, item.finish_reason


def _idle(pair) -> None:
    assert_idle(pair.decode)
    assert_idle(pair.prefill)


def test_a_ticket_filled_by_a_prefill_decodes_to_finished_with_offline_tokens(pair, offline):
    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        record = record_of(pair.decode, "r")
        assert (record.state, ticket.num_blocks) == (S.TICKETED, 3)
        assert await asyncio.to_thread(wait_until, lambda: pair.decode.status().core.reserved_blocks == 3, 5)
        first = await pair.prefill.prefill("r", P, PARAMS, pair.target(ticket))
        return record, [first.first_token_id] + (await _stream(outputs))[0]

    record, tokens = asyncio.run(run())
    assert record.history == [S.TICKETED, S.DECODING, S.FINISHED]
    assert tokens == offline
    status = pair.decode.status()
    assert isinstance(pair.decode, Worker)
    assert (status.role, status.state.value, status.in_flight, status.transfers.count) == ("decode", "serving", 0, 1)
    assert status.transfers.nbytes == 3 * pair.decode.core.capacity.bytes_per_block
    _idle(pair)


def test_a_local_prefill_starts_decoding_and_finishes_with_offline_tokens(pair, offline):
    async def run():
        with loop_held_when(pair.decode, lambda: pair.decode.in_flight == 1):  # to catch the record
            ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0, local_prefill=True)
            record = await asyncio.to_thread(record_of, pair.decode, "r")
        return ticket, record, await _stream(outputs)

    ticket, record, (tokens, reason) = asyncio.run(run())
    assert (ticket.ticket_id, ticket.num_blocks) == (0, 0)
    assert record.history == [S.DECODING, S.FINISHED]
    assert (tokens, reason) == (offline, "length")
    _idle(pair)


def test_an_unfilled_ticket_expires_and_its_stream_ends_abort(pair):
    async def run():
        _, outputs = await pair.decode.admit("r", P, PARAMS, ticket_timeout_s=0.3)
        record = record_of(pair.decode, "r")
        return record, await _stream(outputs)

    record, stream = asyncio.run(run())
    assert record.history == [S.TICKETED, S.EXPIRED]
    assert (record.reason, stream) == ("ticket expired", ([], "abort"))
    _idle(pair)


@pytest.mark.parametrize("state", [S.TICKETED, S.DECODING])
def test_an_abort_in_either_live_state_frees_everything(pair, state):
    async def run():
        local = state is S.DECODING
        with loop_held_when(pair.decode, lambda: any(r.state is state for r in pair.decode.records())) as held:
            _, outputs = await pair.decode.admit("r", P, PARAMS, 60.0, local_prefill=local)
            record = record_of(pair.decode, "r")
            assert await asyncio.to_thread(held.wait, 10)
            aborting = asyncio.create_task(pair.decode.abort("r"))
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(aborting, 10) is True
        return record, await _stream(outputs)

    record, (_, reason) = asyncio.run(run())
    assert record.history == [state, S.ABORTED]
    assert reason == "abort"
    assert asyncio.run(pair.decode.abort("r")) is False  # ended: a second abort is a no-op
    _idle(pair)


def test_kv_that_does_not_fit_the_reservation_fails_the_ticket(pair):
    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        record = record_of(pair.decode, "r")
        payload = pack_blocks(pair.decode.core.kv_caches, [0, 1, 2, 3])  # reserved: 3
        sender = pair.backend.connect(pair.receiver.open_channel())
        sender.send(make_header(ticket.ticket_id, 5, payload), payload)
        return record, await _stream(outputs)

    record, stream = asyncio.run(run())
    assert record.history == [S.TICKETED, S.FAILED]
    assert (record.reason, stream) == ("got 4 blocks, reserved 3", ([], "abort"))
    _idle(pair)


def test_a_failed_engine_step_fails_a_decoding_request(pair):
    execute = pair.decode.core.runner.execute
    calls = []

    def fail_once(plan):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return execute(plan)

    pair.decode.core.runner.execute = fail_once

    async def run():
        with loop_held_when(pair.decode, lambda: pair.decode.in_flight == 1):  # to catch the record
            _, outputs = await pair.decode.admit("r", P, PARAMS, 60.0, local_prefill=True)
            record = await asyncio.to_thread(record_of, pair.decode, "r")
        return record, await _stream(outputs)

    record, stream = asyncio.run(run())
    assert record.history == [S.DECODING, S.FAILED]
    assert (record.reason, stream) == ("the engine aborted it", ([], "abort"))
    _idle(pair)


def test_a_failed_transfer_keeps_the_ticket_for_a_retried_prefill(pair, offline):
    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        record = record_of(pair.decode, "r")
        header = make_header(ticket.ticket_id, 5, pack_blocks(pair.decode.core.kv_caches, [0, 1, 2]))
        pair.receiver.deliver(ReceivedKV(header, None, TransferResult(
            ticket.ticket_id, TransferState.FAILED, 0, 0.0, "peer reset")))
        assert await asyncio.to_thread(wait_until, lambda: pair.decode.status().transfers.failures == 1, 10)
        assert (record.state, pair.decode.in_flight) == (S.TICKETED, 1)
        first = await pair.prefill.prefill("r", P, PARAMS, pair.target(ticket))  # the retry
        return record, [first.first_token_id] + (await _stream(outputs))[0]

    record, tokens = asyncio.run(run())
    assert record.history == [S.TICKETED, S.DECODING, S.FINISHED]
    assert tokens == offline
    _idle(pair)


def test_a_refused_reservation_leaves_no_record(tiny_model_dir):
    pair = make_pair(tiny_model_dir, max_num_seqs=1)
    try:
        async def run():
            first, _ = await pair.decode.admit("a", P, PARAMS, 60.0)
            second, _ = await pair.decode.admit("b", P, PARAMS, 60.0)
            records = [r.request_id for r in pair.decode.records()]
            await pair.decode.abort("a")
            return first, second, records

        first, second, records = asyncio.run(run())
        assert (first.num_blocks, second, records) == (3, None, ["a"])
        _idle(pair)
    finally:
        pair.stop()


def test_an_illegal_move_is_a_bug_that_names_the_history():
    record = DecodeRecord("x", S.TICKETED, emit=lambda item: None)
    move(record, S.DECODING)
    with pytest.raises(AssertionError, match=r"decode request x: illegal move DECODING -> EXPIRED "
                                             r"\(history \['TICKETED', 'DECODING'\]\)"):
        move(record, S.EXPIRED)


def test_the_terminal_states_are_exactly_those_with_no_way_out():
    assert set(TRANSITIONS) == set(S)
    assert TERMINAL == {s for s, nxt in TRANSITIONS.items() if not nxt}
    assert TERMINAL == {S.FINISHED, S.ABORTED, S.EXPIRED, S.FAILED}
