"""Prefill worker: one request's lifecycle (prefill_worker.states.PrefillState).

    Prefill RPC arrives with a ticket from a decode worker (draining: refused UNAVAILABLE)
      -> CONNECTING  the data channel to that decode worker is opened (once per decode worker
                     incarnation, pooled, shared by concurrent requests)
      -> QUEUED      handed to the engine loop; waits for its batch
      -> COMPUTING   prompt chunks run (chunked with other prompts); during the last chunk's
                     forward pass each layer's blocks after the decode worker's cached prefix
                     go on the channel as soon as they are stored (layer_stream.py)
      -> SENDING     first token sampled; it finishes the layer stream (or, where no stream
                     opened, the blocks are packed and queued whole); the blocks are released
      -> SENT        the transfer finished; the first token is returned
    from any non-terminal state:
      -> FAILED      the channel or the transfer failed, the engine dropped it, or it was still
                     in flight when a drain timed out: the RPC fails UNAVAILABLE (router retries)
      -> ABORTED     client gone / Abort RPC; blocks freed wherever they are. Gone while SENDING:
                     the record stays SENDING, abandoned, until its transfer ends (a drain
                     waits for it), then ABORTED
    (terminal: SENT, FAILED, ABORTED; a record is dropped when it ends, holding no block)

Threads: engine state is touched only on the ServingLoop thread. CONNECTING records move on
the asyncio loop, later states on the loop thread, so no two threads race for a record. A
request's future may be cancelled by its RPC at any moment (asyncio.wrap_future cancels it
when the client leaves), so futures are settled only through `_settle`, and one request's
failure never stops the loop from settling the others in the same batch of results.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.serving_loop import ServingLoop, wait_until_async
from kv_transfer.base import ChannelAddress, TransferResult, TransferState
from kv_transfer.packing import make_header, pack_blocks
from kv_transfer.pool import ChannelPool
from prefill_worker.layer_stream import LayerStreams
from prefill_worker.openings import ChannelOpener, ChannelOpenings
from prefill_worker.states import (  # noqa: F401 - the types callers need are re-exported here
    TERMINAL, DecodeTarget, PrefillAborted, PrefillDrained, PrefillDraining, PrefillRecord,
    PrefillResult, PrefillState, Shipment, TransferFailed, move, prefill_params, settle,
)
from worker_runtime.status import DrainResult, TransferTotals, WorkerState, WorkerStatus

logger = logging.getLogger(__name__)

LOOP_COMMAND_TIMEOUT_S = 30.0
"""Longest a drain waits for the engine loop to run one of its commands (one engine step
plus the command; far above any step on the models we serve)."""



class PrefillWorker:
    role: ClassVar[str] = "prefill"

    def __init__(self, core: EngineCore, channels: ChannelPool, open_channel: ChannelOpener,
                 worker_id: str | None = None, backend_name: str = "gloo",
                 transfer_timeout_s: float = 30.0, stream_layers: bool = True) -> None:
        """stream_layers: send KV layer by layer during the last chunk's forward pass where
        the channel can (False: always whole, after the first token)."""
        assert core.scheduler.hold_finished_blocks, "a prefill worker's core must hold finished blocks"
        self.core = core
        self.channels = channels
        self.backend_name = backend_name
        self.transfer_timeout_s = transfer_timeout_s
        """The transport's limit per wire operation (TransferConfig.timeout_s): a drain waits
        a bounded multiple of it for transfers already queued when its own timeout passes."""
        self._openings = ChannelOpenings(open_channel, lanes=channels.lanes)
        channels.on_close = self._openings.forget_address  # an evicted lane reopens, not rejoins
        self.worker_id = worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.loop = ServingLoop(core)
        self._lock = threading.Lock()
        """Guards the indexes below and the worker state (status() reads them on any thread)."""
        self._state = WorkerState.STARTING
        self._live: dict[int, PrefillRecord] = {}
        """Every non-terminal record (abandoned SENDING ones too): what a drain waits for."""
        self._by_request: dict[str, PrefillRecord] = {}
        """Records whose caller still waits, by request id (Abort looks here)."""
        self._by_ticket: dict[int, PrefillRecord] = {}
        """SENDING records by ticket id (transfer results name the ticket)."""
        self._queued: dict[int, PrefillRecord] = {}
        """QUEUED records, watched for their first computed chunk (loop thread only)."""
        self._totals = TransferTotals()
        self._layers = LayerStreams(core, channels) if stream_layers else None

    def start(self) -> None:
        if self._layers is not None:  # before the loop runs: the runner is the loop's own
            self.core.runner.set_step_listener(self._layers.before_forward)
        self.loop.start()
        self.loop.add_poll_hook(self._poll)
        with self._lock:
            if self._state is WorkerState.STARTING:
                self._state = WorkerState.SERVING

    def stop(self) -> None:
        """Stop at once: the loop, the channels; calls still waiting fail (a drain first ends
        them gracefully)."""
        self.loop.stop()
        if self._layers is not None:  # no step will finish them: free their channel threads now
            self._layers.drop_all(f"prefill worker {self.worker_id} stopped")
        self.channels.close()
        with self._lock:
            self._state = WorkerState.STOPPED
        for record in self.records():
            self._end(record, PrefillState.FAILED, TransferFailed(f"prefill worker {self.worker_id} stopped"))

    # ------------------------------------------------------------- reading
    @property
    def in_flight(self) -> int:
        """Requests (or abandoned transfers) this worker still owes; a drain ends at 0."""
        return len(self._live)

    def records(self) -> tuple[PrefillRecord, ...]:
        """The live records now (diagnostics and tests: read them, never write)."""
        with self._lock:
            return tuple(self._live.values())

    def status(self) -> WorkerStatus:
        """A frozen snapshot; any thread; never waits for the engine loop."""
        return WorkerStatus(
            worker_id=self.worker_id, incarnation=self.incarnation, role=self.role, state=self._state,
            block_size=self.core.config.block_size, max_model_len=self.core.max_model_len,
            core=self.loop.stats, in_flight=len(self._live), transfers=self._totals)

    # ---------------------------------------------------------- the RPCs
    async def prefill(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, target: DecodeTarget
    ) -> PrefillResult:
        """Compute the prompt, push its KV to the target, return the first token. Raises
        PrefillDraining when draining, TransferFailed (PrefillAborted, PrefillDrained) when the
        KV was not delivered, ValueError for a prompt the engine refuses or a duplicate id."""
        record = self._accept(request_id, target)
        answer = asyncio.wrap_future(record.future)
        try:
            address = await self._connect(record, target, answer)
            if address is not None and not record.ended:  # ended: stop() raced the opening
                self._move(record, PrefillState.QUEUED)
                await asyncio.wrap_future(self.loop.submit(
                    lambda: self._queue(record, prompt, params, address, target)))
            return await answer
        except asyncio.CancelledError:
            # Shielded: the abort must reach the loop even though this task is being cancelled.
            await asyncio.shield(self._abort(record))
            raise

    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is (its blocks freed); False when unknown or ended."""
        record = self._by_request.get(request_id)
        return False if record is None else await self._abort(record)

    # --------------------------------------------------------------- drain
    async def _on_loop(self, command: Callable[[], int]) -> int:
        """Run a drain's command on the engine loop, bounded: a wedged loop must not hang the
        drain (asyncio.TimeoutError then; the process exits anyway)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.loop.submit(command)), LOOP_COMMAND_TIMEOUT_S)

    def begin_drain(self) -> bool:
        """Refuse new Prefill calls from now on (PrefillDraining). Idempotent; True the first
        time. Any thread."""
        with self._lock:
            if self._state in (WorkerState.DRAINING, WorkerState.STOPPED):
                return False
            self._state = WorkerState.DRAINING
        # debug: the process hosting the worker logs its drain (worker_runtime/process.py)
        logger.debug("prefill worker %s draining, %d in flight", self.worker_id, self.in_flight)
        return True

    async def drain(self, timeout_s: float) -> DrainResult:
        """begin_drain(), wait (at most timeout_s) until nothing is in flight, then fail what
        is left: calls not yet on the wire at once (PrefillDrained, UNAVAILABLE), transfers on
        the wire after the transport's own bounded wait. On return no record is left and no
        block is held. Call on the asyncio loop that serves the worker."""
        started = time.monotonic()
        self.begin_drain()
        before = self.in_flight
        cut = 0
        if not await wait_until_async(lambda: self.in_flight == 0, timeout_s):
            cut = await self._cut(timeout_s)
        result = DrainResult(finished=max(before - cut, 0), aborted=cut, seconds=time.monotonic() - started)
        logger.debug("prefill worker %s drained: %d finished, %d ended by the %g s timeout, %.2f s",
                     self.worker_id, result.finished, result.aborted, timeout_s, result.seconds)
        return result

    async def _cut(self, timeout_s: float) -> int:
        """End what a drain timed out on; the number ended."""
        def drained(record: PrefillRecord) -> PrefillDrained:
            return PrefillDrained(f"prefill worker {self.worker_id} drained: request {record.request_id} "
                                  f"({record.state.name}) ended after the {timeout_s:g} s drain timeout")

        cut = 0
        for record in self.records():
            if record.state is PrefillState.CONNECTING:  # moved only on this (asyncio) thread
                self._end(record, PrefillState.FAILED, drained(record))
                cut += 1
        cut += await self._on_loop(lambda: self._cut_unsent(drained))
        # Transfers already on the wire: the transport ends each within its own timeout (a
        # header, a payload and an ack, each bounded by transfer_timeout_s).
        bound = 3 * self.transfer_timeout_s + 1.0
        if not await wait_until_async(lambda: self.in_flight == 0, bound):
            cut += await self._on_loop(lambda: self._cut_sending(bound))
        return cut

    def _cut_unsent(self, drained: Callable[[PrefillRecord], PrefillDrained]) -> int:
        """Loop thread: end QUEUED and COMPUTING records (their blocks freed)."""
        cut = 0
        for record in self.records():
            if record.state in (PrefillState.QUEUED, PrefillState.COMPUTING):
                self.loop.detach(record.request_id)
                self.core.abort([record.request_id])
                self._end(record, PrefillState.FAILED, drained(record))
                cut += 1
        return cut

    def _cut_sending(self, bound: float) -> int:
        """Loop thread: the transport broke its own timeout; give up on its transfers."""
        cut = 0
        for record in self.records():
            if record.state is PrefillState.SENDING:
                logger.error("ticket %d of %s still unsent %g s after the drain timeout",
                             record.ticket_id, record.request_id, bound)
                state = PrefillState.ABORTED if record.abandoned else PrefillState.FAILED
                self._end(record, state, TransferFailed(f"ticket {record.ticket_id} unsent after {bound:g} s"))
                cut += 1
        return cut

    # ------------------------------------------------------ asyncio side
    def _accept(self, request_id: str, target: DecodeTarget) -> PrefillRecord:
        with self._lock:
            if self._state in (WorkerState.DRAINING, WorkerState.STOPPED):
                raise PrefillDraining(
                    f"prefill worker {self.worker_id} is {self._state.value}: it takes no new requests")
            if request_id in self._by_request:
                raise ValueError(f"request id {request_id!r} is already in flight on {self.worker_id}")
            record = PrefillRecord(request_id, target.ticket_id)
            self._live[record.key] = record
            self._by_request[request_id] = record
        return record

    async def _connect(self, record: PrefillRecord, target: DecodeTarget,
                       answer: asyncio.Future) -> ChannelAddress | None:
        """The channel's address; None when the record ended meanwhile (a drain, a failure)."""
        opening = asyncio.ensure_future(self._openings.get(target.decode_address, target.incarnation))
        try:
            await asyncio.wait((opening, answer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not opening.done():
                opening.cancel()  # only this request's wait: the shared opening is shielded
        if answer.done():  # ended meanwhile; a finished opening's error is read, not leaked
            if opening.done() and not opening.cancelled():
                opening.exception()
            return None
        error = opening.exception()  # done: the wait returned and `answer` is not
        if error is not None:
            self._end(record, PrefillState.FAILED, TransferFailed(
                f"could not open a data channel to {target.decode_address}: {error}"))
            return None
        return opening.result()


    async def _abort(self, record: PrefillRecord) -> bool:
        if record.state is PrefillState.CONNECTING:  # moved only on this (asyncio) thread
            self._end(record, PrefillState.ABORTED, PrefillAborted(f"request {record.request_id} was aborted"))
            return True
        return await asyncio.wrap_future(self.loop.submit(lambda: self._abort_on_loop(record)))

    # -------------------------------------------------- record bookkeeping
    def _move(self, record: PrefillRecord, new: PrefillState, reason: str = "") -> None:
        """Every state change goes through here: checks the table, keeps the indexes."""
        with self._lock:
            move(record, new, reason)
            if new is not PrefillState.QUEUED:
                self._queued.pop(record.key, None)
            if new in TERMINAL:
                self._live.pop(record.key, None)
                if self._by_request.get(record.request_id) is record:
                    del self._by_request[record.request_id]
                if self._by_ticket.get(record.ticket_id) is record:
                    del self._by_ticket[record.ticket_id]
        if new in TERMINAL and self._layers is not None:
            self._layers.drop(record.request_id, reason or new.name)
        logger.debug("prefill %s -> %s %s", record.request_id, new.name, reason)

    def _end(self, record: PrefillRecord, state: PrefillState, error: BaseException | None = None,
             result: PrefillResult | None = None) -> None:
        """Move to a terminal state and answer the caller (if it still waits)."""
        self._move(record, state, str(error) if error is not None else "")
        settle(record.future, result, error)

    # ------------------------------------------------------- loop thread only
    def _queue(self, record: PrefillRecord, prompt, params: SamplingParams, address, target) -> None:
        if record.ended:
            return
        self.loop.attach(record.request_id, lambda output: self._on_first_token(record, output, address, target))
        try:
            self.core.add_request(Request(record.request_id, prompt, prefill_params(params),
                                          self.core.eos_token_ids))
        except ValueError as exc:  # too long, or the id is still in the engine
            self.loop.detach(record.request_id)
            self._end(record, PrefillState.FAILED, exc)
            return
        self._queued[record.key] = record
        if self._layers is not None:
            self._layers.want(record.request_id, address, target)

    def _abort_on_loop(self, record: PrefillRecord) -> bool:
        if record.ended:
            return False
        self.loop.detach(record.request_id)
        self.core.abort([record.request_id])  # frees its blocks wherever they are (held ones too)
        error = PrefillAborted(f"request {record.request_id} was aborted")
        if record.state is not PrefillState.SENDING:
            self._end(record, PrefillState.ABORTED, error)
            return True
        with self._lock:  # on the wire: the transfer still ends (a drain waits), nobody is told
            record.abandoned = True
            if self._by_request.get(record.request_id) is record:
                del self._by_request[record.request_id]
        settle(record.future, error=error)
        return True

    def _on_first_token(self, record: PrefillRecord, output: EngineCoreOutput, address, target) -> None:
        record.timing.first_token()
        if record.ended:  # cannot happen while attached; never leave blocks behind
            self.core.release_blocks(record.request_id)
            return
        if not output.new_token_ids:  # the engine dropped it (a failed step)
            self._end(record, PrefillState.FAILED,
                      PrefillAborted(f"request {record.request_id} was aborted before its first token"))
            return
        try:
            if not self._finish_stream(record, output, target):
                self._send(record, output, address, target)
        except Exception as exc:  # this request fails; the loop and the others go on
            logger.exception("sending the KV of %s failed", record.request_id)
            self.core.release_blocks(record.request_id)
            if not record.ended:
                self._end(record, PrefillState.FAILED, TransferFailed(f"could not send the KV: {exc}"))

    def _send(self, record: PrefillRecord, first: EngineCoreOutput, address, target: DecodeTarget) -> None:
        """Pack and queue the request's blocks; they are released here whatever happens next."""
        try:
            block_size = self.core.config.block_size
            block_ids = self.core.held_block_ids(record.request_id)[target.num_cached_tokens // block_size:]
            payload = pack_blocks(self.core.kv_caches, block_ids)
        finally:
            self.core.release_blocks(record.request_id)  # pack_blocks copied them (or failed)
        if payload.shape[2] != target.num_blocks:
            self._end(record, PrefillState.FAILED, TransferFailed(
                f"ticket {target.ticket_id}: decode reserved {target.num_blocks} blocks, prompt has "
                f"{payload.shape[2]} after its cached prefix"))
            return
        sender = self.channels.get(address)
        if sender is None:
            self._end(record, PrefillState.FAILED, TransferFailed(f"no channel to {target.decode_address}"))
            return
        try:
            sender.send(make_header(target.ticket_id, first.new_token_ids[0], payload, first.sampled_at),
                        payload.contiguous())
        except Exception as exc:  # a closed sender, a ticket still outstanding: this request only
            self._end(record, PrefillState.FAILED, TransferFailed(f"could not send ticket {target.ticket_id}: {exc}"))
            return
        self._shipped(record, first, payload.shape[2], target)

    def _finish_stream(self, record: PrefillRecord, first: EngineCoreOutput, target: DecodeTarget) -> bool:
        """Finish the request's layer stream, if one carries all its blocks; True then (its
        blocks released: every layer was copied into the feed during the step)."""
        if self._layers is None:
            return False
        block_size = self.core.config.block_size
        held = self.core.held_block_ids(record.request_id)[target.num_cached_tokens // block_size:]
        feed = self._layers.take(record.request_id, held)
        if feed is None:
            return False
        self.core.release_blocks(record.request_id)
        feed.finish(first.new_token_ids[0], first.sampled_at)
        self._shipped(record, first, feed.header.num_blocks, target)
        return True

    def _shipped(self, record: PrefillRecord, first: EngineCoreOutput, num_blocks: int, target: DecodeTarget) -> None:
        record.shipment = Shipment(first, num_blocks, (target.decode_address, target.incarnation))
        with self._lock:
            self._by_ticket[target.ticket_id] = record
        self._move(record, PrefillState.SENDING)

    def _poll(self) -> None:
        self._note_progress()
        self._poll_transfers()

    def _note_progress(self) -> None:
        """QUEUED -> COMPUTING once the engine has computed a chunk of the prompt; until then,
        stamp it as still waiting (this hook runs just before each step)."""
        now = time.monotonic()
        for record in list(self._queued.values()):
            request = self.core.scheduler.requests.get(record.request_id)
            if request is not None and request.num_computed_tokens > 0:
                self._move(record, PrefillState.COMPUTING)
            else:
                record.timing.unscheduled_at = now

    def _poll_transfers(self) -> None:
        """Settle every finished transfer's request; each is handled on its own, so a request
        whose client left (its future cancelled) never hides the results polled with it."""
        for result in self.channels.poll():
            record = self._by_ticket.get(result.ticket_id)
            if record is None or record.ended:
                continue
            try:
                self._finish_transfer(record, result)
            except Exception:
                logger.exception("settling the transfer of %s failed", record.request_id)
                if not record.ended:
                    self._end(record, PrefillState.FAILED, TransferFailed("internal error while finishing the transfer"))

    def _finish_transfer(self, record: PrefillRecord, result: TransferResult) -> None:
        shipment = record.shipment
        assert shipment is not None, f"SENDING record {record.request_id} has no shipment"
        if result.state is TransferState.FAILED:
            # The channel is gone; the next request to that decode worker opens a new one.
            self._openings.forget(shipment.channel_key)
            self._totals = replace(self._totals, failures=self._totals.failures + 1)
            state = PrefillState.ABORTED if record.abandoned else PrefillState.FAILED
            self._end(record, state, TransferFailed(result.error or "transfer failed"))
            return
        t = self._totals
        self._totals = TransferTotals(t.count + 1, t.nbytes + result.nbytes, t.seconds + result.seconds, t.failures)
        if record.abandoned:
            self._move(record, PrefillState.ABORTED, "the client left while its KV was on the wire")
            return
        queue_s, compute_s = record.timing.split()
        self._end(record, PrefillState.SENT, result=PrefillResult(
            first_token_id=shipment.first.new_token_ids[0],
            first_logprobs=shipment.first.logprobs,
            num_cached_tokens=shipment.first.num_cached_tokens,
            nbytes=result.nbytes,
            seconds=result.seconds,
            num_blocks=shipment.num_blocks,
            queue_s=queue_s,
            compute_s=compute_s,
            first_token_at=record.timing.first_token_unix,
            wire_seconds=result.wire_seconds,
        ))
