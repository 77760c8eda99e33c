"""Decode worker: reservation, KV arrival, decoding — one request's lifecycle
(decode_worker.states.DecodeState).

    Decode RPC arrives
         draining                          -> refused UNAVAILABLE at once (router tries the next)
      -> reserve blocks for the prompt (less this worker's own prefix-cache hit)
         refused (no blocks / batch full)  -> RESOURCE_EXHAUSTED at once, marked no-room
                                              (proto.limits), nothing held, no record
      -> TICKETED: ticket sent to the router, which asks a prefill worker to fill it
         KV arrives on the data channel    -> written into the blocks on the import thread
                                              (decode_worker.kv_import), then committed on
                                              the loop, first token appended: DECODING (with
                                              stream_first_token, the first token is streamed
                                              now, before the router has the Prefill reply)
         ticket deadline passes            -> EXPIRED, blocks freed, stream ends "abort"
         payload does not fit / import fails -> FAILED, blocks freed, stream ends "abort"
         transfer fails                    -> stays TICKETED (the router retries the prefill)
      -> DECODING (a local prefill starts here): tokens stream back
         stop / length                     -> FINISHED
         engine step fails                 -> FAILED, stream ends "abort"
    from TICKETED or DECODING:
         client gone / Abort RPC           -> ABORTED, blocks freed
         drain timeout passes              -> FAILED, blocks freed, the stream ends with an
                                              UNAVAILABLE error naming the drain
    (terminal: FINISHED, ABORTED, EXPIRED, FAILED; a record is dropped when it ends)

All engine state, and every record, is touched only on the ServingLoop thread; RPC handlers
submit commands and read an asyncio queue per request. status() reads counters any thread.
The one exception is the KV of a TICKETED request: the import thread writes its reserved
blocks, and the loop cancels that landing before it frees them (kv_import.py says how).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from decode_worker.kv_import import Arrival, EarlySink, KVImporter
from decode_worker.states import (  # noqa: F401 - the types callers need are re-exported here
    TERMINAL, DecodeDraining, DecodeRecord, DecodeState, StreamFailed, StreamItem, move,
)
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.serving_loop import ServingLoop, wait_until_async
from kv_transfer.base import ChannelAddress, KVReceiver, TransferHeader, TransferState
from worker_runtime.status import DrainResult, TransferTotals, WorkerState, WorkerStatus

logger = logging.getLogger(__name__)

LOOP_COMMAND_TIMEOUT_S = 30.0
"""Longest a drain waits for the engine loop to run one of its commands (one engine step
plus the command; far above any step on the models we serve)."""


@dataclass(frozen=True)
class TicketInfo:
    ticket_id: int
    num_cached_tokens: int
    num_blocks: int


class DecodeWorker:
    role: ClassVar[str] = "decode"

    def __init__(self, core: EngineCore, receiver: KVReceiver, worker_id: str | None = None) -> None:
        self.core = core
        self.receiver = receiver
        self.worker_id = worker_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.loop = ServingLoop(core)
        self.importer = KVImporter(receiver, core.kv_caches, nice=core.engine_nice)
        """Writes arriving KV into reserved blocks on its own thread, off the engine step."""
        self._lock = threading.Lock()
        """Guards the worker state and `_live` for readers on other threads."""
        self._state = WorkerState.STARTING
        self._live: dict[str, DecodeRecord] = {}
        """Every non-terminal record, by request id: what a drain waits for."""
        self._tickets: dict[int, DecodeRecord] = {}
        """TICKETED records by ticket id (loop thread only)."""
        self._totals = TransferTotals()
        """Received transfers, counted on the loop thread; replaced whole, read anywhere."""

    def start(self) -> None:
        self.loop.start()
        self.importer.start()
        self.loop.add_poll_hook(self._poll_transfers)
        with self._lock:
            if self._state is WorkerState.STARTING:
                self._state = WorkerState.SERVING

    def stop(self) -> None:
        """Stop at once: the loop, the receiver; streams still open end with an error (a drain
        first ends them gracefully)."""
        self.loop.stop()
        self.importer.stop()
        self.receiver.close()
        with self._lock:
            self._state = WorkerState.STOPPED
        for record in self.records():
            self._move(record, DecodeState.FAILED, "worker stopped")
            try:
                record.emit(StreamFailed(f"decode worker {self.worker_id} stopped"))
            except RuntimeError:  # its asyncio loop is already closed: nobody reads it
                pass

    # ------------------------------------------------------------- reading
    @property
    def in_flight(self) -> int:
        """Requests this worker owes an answer (TICKETED and DECODING); a drain ends at 0."""
        return len(self._live)

    def records(self) -> tuple[DecodeRecord, ...]:
        """The live records now (diagnostics and tests: read them, never write)."""
        with self._lock:
            return tuple(self._live.values())

    def status(self) -> WorkerStatus:
        """A frozen snapshot; any thread; never waits for the engine loop."""
        return WorkerStatus(
            worker_id=self.worker_id, incarnation=self.incarnation, role=self.role, state=self._state,
            block_size=self.core.config.block_size, max_model_len=self.core.max_model_len,
            core=self.loop.stats, in_flight=len(self._live), transfers=self._totals)

    # ------------------------------------------------------------ admission
    async def admit(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, ticket_timeout_s: float,
        local_prefill: bool = False, stream_first_token: bool = False,
    ) -> tuple[TicketInfo | None, asyncio.Queue[StreamItem]]:
        """Reserve blocks; on success the request's outputs (or a final StreamFailed) go to the
        returned queue. local_prefill: queue the whole request here instead (ticket 0, nothing
        reserved). stream_first_token: the prefill's first token is the first output, as soon
        as its KV is in (else the stream starts at the second token). Raises DecodeDraining when
        draining, ValueError for a prompt the engine refuses or an id in use; None ticket: no
        room now (nothing held)."""
        self._refuse_if_draining()
        aio_loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StreamItem] = asyncio.Queue()

        def emit(item: StreamItem) -> None:
            aio_loop.call_soon_threadsafe(outputs.put_nowait, item)

        try:
            ticket = await asyncio.wrap_future(self.loop.submit(
                lambda: self._reserve(Request(request_id, prompt, params, self.core.eos_token_ids),
                                      emit, ticket_timeout_s, local_prefill, stream_first_token)))
        except asyncio.CancelledError:
            # The caller left while the reservation ran: nobody will read the ticket, so free
            # now rather than at the ticket's deadline. Shielded: this task is being cancelled.
            await asyncio.shield(self.abort(request_id))
            raise
        return ticket, outputs

    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is (blocks freed; its stream ends "abort"). False when
        unknown or already ended."""
        return await asyncio.wrap_future(self.loop.submit(lambda: self._abort(request_id)))

    def open_channel(self) -> ChannelAddress:
        return self.receiver.open_channel()

    # --------------------------------------------------------------- drain
    async def _on_loop(self, command: Callable[[], int]) -> int:
        """Run a drain's command on the engine loop, bounded: a wedged loop must not hang the
        drain (asyncio.TimeoutError then; the process exits anyway)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.loop.submit(command)), LOOP_COMMAND_TIMEOUT_S)

    def begin_drain(self) -> bool:
        """Refuse new Decode calls from now on (DecodeDraining). Idempotent; True the first
        time. Any thread."""
        with self._lock:
            if self._state in (WorkerState.DRAINING, WorkerState.STOPPED):
                return False
            self._state = WorkerState.DRAINING
        # debug: the process hosting the worker logs its drain (worker_runtime/process.py)
        logger.debug("decode worker %s draining, %d in flight", self.worker_id, self.in_flight)
        return True

    async def drain(self, timeout_s: float) -> DrainResult:
        """begin_drain(), wait (at most timeout_s) for TICKETED requests to get their KV and
        every request to finish; then end the rest: blocks freed, each stream ends with an
        UNAVAILABLE error naming the drain. Call on the asyncio loop that serves the worker."""
        started = time.monotonic()
        self.begin_drain()
        before = self.in_flight
        cut = 0
        if not await wait_until_async(lambda: self.in_flight == 0, timeout_s):
            cut = await self._on_loop(lambda: self._cut(timeout_s))
        result = DrainResult(finished=max(before - cut, 0), aborted=cut, seconds=time.monotonic() - started)
        logger.debug("decode worker %s drained: %d finished, %d ended by the %g s timeout, %.2f s",
                     self.worker_id, result.finished, result.aborted, timeout_s, result.seconds)
        return result

    def _refuse_if_draining(self) -> None:
        state = self._state
        if state in (WorkerState.DRAINING, WorkerState.STOPPED):
            raise DecodeDraining(f"decode worker {self.worker_id} is {state.value}: it takes no new requests")

    # -------------------------------------------------------- loop thread only
    def _reserve(self, request: Request, emit, ticket_timeout_s: float, local_prefill: bool,
                 stream_first_token: bool = False) -> TicketInfo | None:
        self._refuse_if_draining()  # again here: ordered with the drain's own commands
        if local_prefill:
            self.core.add_request(request)
            self._adopt(DecodeRecord(request.request_id, DecodeState.DECODING, emit))
            return TicketInfo(0, 0, 0)
        reservation = self.core.reserve_remote(request)
        if reservation is None:
            return None
        # Random 62-bit ids: a prefill worker serves many decode workers, so ids must be
        # unique across them without coordination (a counter per worker would collide).
        ticket_id = secrets.randbits(62) or 1
        while ticket_id in self._tickets:
            ticket_id = secrets.randbits(62) or 1
        record = DecodeRecord(request.request_id, DecodeState.TICKETED, emit, ticket_id,
                              reservation.block_ids, time.monotonic() + ticket_timeout_s,
                              stream_first_token=stream_first_token)
        self._tickets[ticket_id] = record
        early = self._early_first_token(record, request) if stream_first_token else None
        self.importer.expect(ticket_id, reservation.block_ids, early)
        self._adopt(record)
        return TicketInfo(ticket_id, reservation.num_cached_tokens, len(reservation.block_ids))

    def _adopt(self, record: DecodeRecord) -> None:
        with self._lock:
            self._live[record.request_id] = record
        self.loop.attach(record.request_id, lambda output: self._on_output(record, output))

    def _on_output(self, record: DecodeRecord, output: EngineCoreOutput) -> None:
        """Moves first, then emits: whoever reads the last output sees the record ended."""
        if output.finish_reason is not None and not record.ended:
            if output.finish_reason == "abort":  # the engine dropped it (a failed step)
                self._move(record, DecodeState.FAILED, "the engine aborted it")
            else:
                self._move(record, DecodeState.FINISHED)
        record.emit(output)

    def _move(self, record: DecodeRecord, new: DecodeState, reason: str = "") -> None:
        """Every state change goes through here: checks the table, keeps the indexes."""
        move(record, new, reason)
        if new is not DecodeState.TICKETED and record.ticket_id is not None:
            if self._tickets.get(record.ticket_id) is record:
                del self._tickets[record.ticket_id]
            # Before any caller frees the blocks: no KV write lands in them after this.
            self.importer.cancel(record.ticket_id)
        if new in TERMINAL:
            with self._lock:
                if self._live.get(record.request_id) is record:
                    del self._live[record.request_id]
        logger.debug("decode %s -> %s %s", record.request_id, new.name, reason)

    def _end(self, record: DecodeRecord, state: DecodeState, reason: str) -> None:
        """End a live record in the engine: blocks freed, its stream ends "abort"."""
        self._move(record, state, reason)
        for request in self.core.abort([record.request_id]):
            self.loop.deliver(EngineCoreOutput(request.request_id, (), None, "abort", None))
        self.loop.detach(record.request_id)

    def _abort(self, request_id: str) -> bool:
        record = self._live.get(request_id)
        if record is None:
            return False
        self._end(record, DecodeState.ABORTED, "aborted")
        return True

    def _cut(self, timeout_s: float) -> int:
        """End every request a drain timed out on, each stream with an explicit error."""
        records = self.records()
        for record in records:
            why = (f"decode worker {self.worker_id} drained: request {record.request_id} "
                   f"({record.state.name}) ended after the {timeout_s:g} s drain timeout")
            self._move(record, DecodeState.FAILED, why)
            self.loop.detach(record.request_id)  # no "abort" output: the error below ends it
            self.core.abort([record.request_id])
            record.emit(StreamFailed(why))
        return len(records)

    def _poll_transfers(self) -> None:
        """Commit every imported transfer, each on its own: one that fails (a bad payload, an
        aborted request) fails only its own request and never hides the others in the batch.
        The KV is already in the blocks (the import thread wrote it): no copy on this thread."""
        for arrival in self.importer.take():
            try:
                self._on_arrival(arrival)
            except Exception:
                logger.exception("committing the KV of ticket %d failed", arrival.header.ticket_id)
                record = self._tickets.get(arrival.header.ticket_id)
                if record is not None and not record.ended:
                    self._end(record, DecodeState.FAILED, "importing its KV failed")
        now = time.monotonic()
        for ticket_id, record in list(self._tickets.items()):
            if record.deadline < now:
                logger.warning("ticket %d (%s) expired before its KV arrived", ticket_id, record.request_id)
                self._end(record, DecodeState.EXPIRED, "ticket expired")

    def _on_arrival(self, arrival: Arrival) -> None:
        ticket_id, result = arrival.header.ticket_id, arrival.result
        record = self._tickets.get(ticket_id)
        if record is None:
            logger.warning("KV for unknown or expired ticket %d dropped", ticket_id)
            return
        if result.state is TransferState.FAILED:
            # Keep the reservation: the router retries the prefill elsewhere with the same
            # ticket; if nobody fills it, the deadline frees it.
            self._totals = replace(self._totals, failures=self._totals.failures + 1)
            logger.warning("KV transfer for ticket %d failed: %s", ticket_id, result.error)
            return
        if arrival.error is not None:
            self._end(record, DecodeState.FAILED, arrival.error)
            return
        t = self._totals
        self._totals = TransferTotals(t.count + 1, t.nbytes + result.nbytes, t.seconds + result.seconds, t.failures)
        self._move(record, DecodeState.DECODING)
        output = self.core.commit_remote(record.request_id, arrival.header.first_token_id)
        if record.stream_first_token and not arrival.first_token_sent:
            output = self._first_token(record, arrival, output)
        if output is not None:
            self.loop.deliver(output)

    def _early_first_token(self, record: DecodeRecord, request: Request) -> EarlySink:
        """Streams the prefill's first token from the receiving thread the moment its payload is
        here, instead of at the loop's next step boundary (a decode step of a full batch took
        150-200 ms here). Declines (the loop streams it with its finish after the commit) when
        that token may end the request: a finish must ride on the same output as its token."""
        max_tokens, limit = request.sampling_params.max_tokens, self.core.max_model_len

        def sink(header: TransferHeader) -> bool:
            token = header.first_token_id
            if (max_tokens is not None and max_tokens <= 1) or request.num_prompt_tokens + 1 >= limit \
                    or token in request.stop_token_ids:
                return False
            record.emit(EngineCoreOutput(record.request_id, (token,), None, None, None,
                                         sampled_at=_sampled_at(header, time.time())))
            return True
        return sink

    @staticmethod
    def _first_token(record: DecodeRecord, arrival: Arrival, ended: EngineCoreOutput | None) -> EngineCoreOutput:
        """The prefill's first token as this stream's first output (with the finish when that
        token already ends the request). Stamped with P's sample time when the header carries
        it, else with the time its KV was in here."""
        header = arrival.header
        base = ended or EngineCoreOutput(record.request_id, (), None, None, None)
        return replace(base, new_token_ids=(header.first_token_id,), sampled_at=_sampled_at(header, arrival.arrived_at))


def _sampled_at(header: TransferHeader, fallback: float) -> float:
    """The first token's sample time on P (unix s) when the header carries it, else `fallback`."""
    return header.first_token_at_us / 1e6 if header.first_token_at_us else fallback
