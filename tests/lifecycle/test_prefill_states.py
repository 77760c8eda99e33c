"""The real PrefillWorker's named states (prefill_worker.states), driven through every
transition with the tiny model and the in-process `local` transfer backend: the full path,
each failure, and an abort (the client leaving, or the Abort RPC) in every non-terminal state.
Each test ends with no record left and no block held on either worker."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from prefill_worker.states import TERMINAL, TRANSITIONS, PrefillRecord, move
from prefill_worker.worker import (
    DecodeTarget, PrefillAborted, PrefillResult, PrefillState, TransferFailed,
)
from tests.lifecycle.pd_pair import (
    assert_idle, loop_held, loop_held_when, make_pair, prompt, record_of,
)
from tests.tiny_model import tiny_llm
from worker_runtime.status import Worker

S = PrefillState
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = prompt(200, 1)   # 13 blocks; computed in 7 chunks of at most 32 tokens
SHORT = prompt(20, 2)   # one step


@pytest.fixture()
def pair(tiny_model_dir):
    p = make_pair(tiny_model_dir, max_num_batched_tokens=32)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    outputs = tiny_llm(tiny_model_dir).generate([list(LONG), list(SHORT)], PARAMS)
    return {LONG: list(outputs[0].token_ids), SHORT: list(outputs[1].token_ids)}


async def _stream(outputs) -> list[int]:
    tokens = []
    while True:
        item = await asyncio.wait_for(outputs.get(), 30)
        tokens += item.new_token_ids
        if item.finish_reason is not None:
            return tokens


async def _start(pair, rid: str, p: tuple[int, ...]):
    """Admit on the decode worker, then start the prefill with its ticket; the prefill's
    record is caught while the engine loop is held (so even a one-step prompt is seen)."""
    ticket, outputs = await pair.decode.admit(rid, p, PARAMS, 60.0)
    with loop_held(pair.prefill):
        task = asyncio.create_task(pair.prefill.prefill(rid, p, PARAMS, pair.target(ticket)))
        record = await asyncio.to_thread(record_of, pair.prefill, rid)
        await asyncio.to_thread(wait_until, lambda: record.state is not S.CONNECTING, 10)
    return task, record, outputs


def _idle(pair) -> None:
    assert_idle(pair.prefill)
    assert_idle(pair.decode)


@pytest.mark.parametrize("p,path", [
    (LONG, [S.CONNECTING, S.QUEUED, S.COMPUTING, S.SENDING, S.SENT]),
    (SHORT, [S.CONNECTING, S.QUEUED, S.SENDING, S.SENT]),  # computed within one step
])
def test_a_prefill_walks_its_states_to_sent_and_the_tokens_match_offline(pair, offline, p, path):
    async def run():
        task, record, outputs = await _start(pair, "r", p)
        result = await asyncio.wait_for(task, 30)
        return record, result, await _stream(outputs)

    record, result, rest = asyncio.run(run())
    assert record.history == path
    assert isinstance(result, PrefillResult)
    assert [result.first_token_id] + rest == offline[p]
    assert result.num_blocks == -(-len(p) // 16)
    status = pair.prefill.status()
    assert isinstance(pair.prefill, Worker)
    assert (status.role, status.state.value, status.in_flight) == ("prefill", "serving", 0)
    assert (status.transfers.count, status.transfers.nbytes, status.transfers.failures) == (1, result.nbytes, 0)
    _idle(pair)


def test_a_prefill_reports_its_queue_and_compute_time_and_when_its_first_token_was_sampled(pair):
    async def run():
        t0 = time.time()
        ticket, outputs = await pair.decode.admit("t", LONG, PARAMS, 60.0)
        with loop_held(pair.prefill):  # it waits behind a busy engine loop for 0.3 s
            task = asyncio.create_task(pair.prefill.prefill("t", LONG, PARAMS, pair.target(ticket)))
            await asyncio.sleep(0.3)
        result = await asyncio.wait_for(task, 30)
        await _stream(outputs)
        return t0, time.time(), result

    t0, t1, result = asyncio.run(run())
    assert result.queue_s >= 0.25
    assert result.compute_s > 0
    assert result.queue_s + result.compute_s <= t1 - t0
    assert t0 + result.queue_s <= result.first_token_at <= t1
    _idle(pair)


def _hold(pair, state: PrefillState):
    """A context that keeps the next LONG prefill in `state` until it exits."""
    if state is S.CONNECTING:
        pair.opener.hold = True
        return _Released(lambda: pair.opener.go.set())
    if state is S.QUEUED:
        return loop_held(pair.prefill)
    if state is S.COMPUTING:
        return loop_held_when(pair.prefill, lambda: any(r.state is S.COMPUTING for r in pair.prefill.records()))
    pair.pool.held = True
    return _Released(lambda: setattr(pair.pool, "held", False))


class _Released:
    def __init__(self, release) -> None:
        self.release = release

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


PATHS = {
    S.CONNECTING: [S.CONNECTING],
    S.QUEUED: [S.CONNECTING, S.QUEUED],
    S.COMPUTING: [S.CONNECTING, S.QUEUED, S.COMPUTING],
    S.SENDING: [S.CONNECTING, S.QUEUED, S.COMPUTING, S.SENDING],
}


@pytest.mark.parametrize("how", ["client leaves", "abort rpc"])
@pytest.mark.parametrize("state", list(PATHS))
def test_an_abort_in_any_state_ends_aborted_with_no_block_held(pair, state, how):
    async def run():
        ticket, _ = await pair.decode.admit("r", LONG, PARAMS, 60.0)
        with _hold(pair, state):
            task = asyncio.create_task(pair.prefill.prefill("r", LONG, PARAMS, pair.target(ticket)))
            record = await asyncio.to_thread(record_of, pair.prefill, "r")
            assert await asyncio.to_thread(wait_until, lambda: record.state is state, 10), record.history
            if how == "client leaves":
                task.cancel()
                aborting = None
            else:
                aborting = asyncio.create_task(pair.prefill.abort("r"))
            await asyncio.sleep(0.05)
            if state is S.SENDING:  # on the wire: the transfer is still owed, and a drain waits
                assert (record.state, record.abandoned, pair.prefill.in_flight) == (S.SENDING, True, 1)
        outcome = await asyncio.gather(task, return_exceptions=True)
        if aborting is not None:
            assert await asyncio.wait_for(aborting, 10) is True
        await asyncio.to_thread(wait_until, lambda: record.ended, 10)
        await pair.decode.abort("r")  # as the router does
        return record, outcome[0]

    record, outcome = asyncio.run(run())
    assert record.history == PATHS[state] + [S.ABORTED]
    if how == "client leaves":
        assert isinstance(outcome, asyncio.CancelledError)
    else:
        assert isinstance(outcome, PrefillAborted) and str(outcome) == "request r was aborted"
    _idle(pair)


def test_a_channel_that_cannot_open_fails_from_connecting(pair):
    pair.opener.fail, pair.opener.hold = "connection refused", True

    async def run():
        task = asyncio.create_task(pair.prefill.prefill("r", SHORT, PARAMS, DecodeTarget("decode:1", "i", 7, 0, 2)))
        record = await asyncio.to_thread(record_of, pair.prefill, "r")
        pair.opener.go.set()
        return record, (await asyncio.gather(task, return_exceptions=True))[0]

    record, error = asyncio.run(run())
    assert record.history == [S.CONNECTING, S.FAILED]
    assert isinstance(error, TransferFailed)
    assert str(error) == "could not open a data channel to decode:1: connection refused"
    _idle(pair)


def test_a_prompt_the_engine_refuses_fails_from_queued(pair):
    too_long = prompt(600, 3)

    async def run():
        with loop_held(pair.prefill):
            task = asyncio.create_task(pair.prefill.prefill("r", too_long, PARAMS, DecodeTarget("decode:1", "i", 7, 0, 38)))
            record = await asyncio.to_thread(record_of, pair.prefill, "r")
        return record, (await asyncio.gather(task, return_exceptions=True))[0]

    record, error = asyncio.run(run())
    assert record.history == [S.CONNECTING, S.QUEUED, S.FAILED]
    assert isinstance(error, ValueError)
    assert str(error).startswith("This model's maximum context length is 512 tokens. However, you requested 601")
    _idle(pair)


def test_a_ticket_with_the_wrong_block_count_fails_after_computing(pair):
    async def run():
        with loop_held(pair.prefill):
            task = asyncio.create_task(pair.prefill.prefill("r", LONG, PARAMS, DecodeTarget("decode:1", "i", 5, 0, 3)))
            record = await asyncio.to_thread(record_of, pair.prefill, "r")
        return record, (await asyncio.gather(task, return_exceptions=True))[0]

    record, error = asyncio.run(run())
    assert record.history == [S.CONNECTING, S.QUEUED, S.COMPUTING, S.FAILED]
    assert str(error) == "ticket 5: decode reserved 3 blocks, prompt has 13 after its cached prefix"
    _idle(pair)


def test_a_failed_transfer_fails_from_sending_and_is_counted(pair):
    async def run():
        ticket, _ = await pair.decode.admit("r", LONG, PARAMS, 60.0)
        with loop_held(pair.prefill):
            task = asyncio.create_task(pair.prefill.prefill("r", LONG, PARAMS, pair.target(ticket)))
            record = await asyncio.to_thread(record_of, pair.prefill, "r")
            await asyncio.to_thread(wait_until, lambda: record.state is S.QUEUED, 10)
            for address in list(pair.backend.channels):  # the decode side closes the channel
                pair.receiver.close_channel(address)
        error = (await asyncio.gather(task, return_exceptions=True))[0]
        await pair.decode.abort("r")
        return record, error

    record, error = asyncio.run(run())
    assert record.history == [S.CONNECTING, S.QUEUED, S.COMPUTING, S.SENDING, S.FAILED]
    assert isinstance(error, TransferFailed) and str(error) == "no local channel 'local-1'"
    assert pair.prefill.status().transfers.failures == 1
    _idle(pair)


def test_an_illegal_move_is_a_bug_that_names_the_history():
    record = PrefillRecord("x", 1)
    move(record, S.QUEUED)
    with pytest.raises(AssertionError, match=r"prefill request x: illegal move QUEUED -> SENT "
                                             r"\(history \['CONNECTING', 'QUEUED'\]\)"):
        move(record, S.SENT)


def test_the_terminal_states_are_exactly_those_with_no_way_out():
    assert set(TRANSITIONS) == set(S)
    assert TERMINAL == {s for s, nxt in TRANSITIONS.items() if not nxt} == {S.SENT, S.FAILED, S.ABORTED}
