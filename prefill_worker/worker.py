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
when the client leaves), so futures are settled only through states.settle, and one
request's failure never stops the loop from settling the others in the same batch of results.

Parts, by concern: records.py (the records, their indexes and the worker state, one lock),
runs.py (a request's time in the engine), shipping.py (its KV to the decode worker),
layer_stream.py (the KV layer by layer during the last chunk), drain.py, openings.py (the
data channels being opened). This class wires them and answers the RPCs.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import ClassVar

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.serving_loop import ServingLoop
from kv_transfer.base import ChannelAddress
from kv_transfer.pool import ChannelPool
from prefill_worker.drain import PrefillDrain
from prefill_worker.layer_stream import LayerStreams
from prefill_worker.openings import ChannelOpener, ChannelOpenings
from prefill_worker.records import PrefillRecords
from prefill_worker.runs import PrefillRuns
from prefill_worker.shipping import KVShipper
from prefill_worker.states import (  # noqa: F401 - the types callers need are re-exported here
    TERMINAL, DecodeTarget, PrefillAborted, PrefillDrained, PrefillDraining, PrefillRecord,
    PrefillResult, PrefillState, Shipment, TransferFailed, move, prefill_params, settle,
)
from worker_runtime.status import DrainResult, WorkerStatus


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
        self._layers = LayerStreams(core, channels) if stream_layers else None
        self._records = PrefillRecords(self.worker_id, on_end=self._layers.drop if self._layers else None)
        self._shipper = KVShipper(core, channels, self._records, self._layers, self._openings.forget)
        self._runs = PrefillRuns(core, self.loop, self._records, self._layers, self._shipper)
        self._drain = PrefillDrain(self.worker_id, self._records, self.loop, self._runs, transfer_timeout_s)

    def start(self) -> None:
        if self._layers is not None:  # before the loop runs: the runner is the loop's own
            self.core.runner.set_step_listener(self._layers.before_forward)
        self.loop.start()
        self.loop.add_poll_hook(self._runs.poll)
        self._records.serve()

    def stop(self) -> None:
        """Stop at once: the loop, the channels; calls still waiting fail (a drain first ends
        them gracefully)."""
        self.loop.stop()
        if self._layers is not None:  # no step will finish them: free their channel threads now
            self._layers.drop_all(f"prefill worker {self.worker_id} stopped")
        self.channels.close()
        self._records.stopped()
        for record in self.records():
            self._records.end(record, PrefillState.FAILED, TransferFailed(f"prefill worker {self.worker_id} stopped"))

    # ------------------------------------------------------------- reading
    @property
    def in_flight(self) -> int:
        """Requests (or abandoned transfers) this worker still owes; a drain ends at 0."""
        return len(self._records)

    def records(self) -> tuple[PrefillRecord, ...]:
        """The live records now (diagnostics and tests: read them, never write)."""
        return self._records.all()

    def status(self) -> WorkerStatus:
        """A frozen snapshot; any thread; never waits for the engine loop."""
        return WorkerStatus(
            worker_id=self.worker_id, incarnation=self.incarnation, role=self.role, state=self._records.state,
            block_size=self.core.config.block_size, max_model_len=self.core.max_model_len,
            core=self.loop.stats, in_flight=len(self._records), transfers=self._shipper.totals)

    # ---------------------------------------------------------- the RPCs
    async def prefill(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, target: DecodeTarget
    ) -> PrefillResult:
        """Compute the prompt, push its KV to the target, return the first token. Raises
        PrefillDraining when draining, TransferFailed (PrefillAborted, PrefillDrained) when the
        KV was not delivered, ValueError for a prompt the engine refuses or a duplicate id."""
        record = self._records.accept(request_id, target.ticket_id)
        answer = asyncio.wrap_future(record.future)
        try:
            address = await self._connect(record, target, answer)
            if address is not None and not record.ended:  # ended: stop() raced the opening
                self._records.move(record, PrefillState.QUEUED)
                await asyncio.wrap_future(self.loop.submit(
                    lambda: self._runs.queue(record, prompt, params, address, target)))
            return await answer
        except asyncio.CancelledError:
            # Shielded: the abort must reach the loop even though this task is being cancelled.
            await asyncio.shield(self._abort(record))
            raise

    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is (its blocks freed); False when unknown or ended."""
        record = self._records.waiting(request_id)
        return False if record is None else await self._abort(record)

    def begin_drain(self) -> bool:
        """Refuse new Prefill calls from now on (PrefillDraining). Idempotent; True the first
        time. Any thread."""
        return self._drain.begin()

    async def drain(self, timeout_s: float) -> DrainResult:
        """Refuse new calls, wait (at most timeout_s) for those in flight, end the rest; on
        return no record is left and no block is held (drain.py). Call on the asyncio loop
        that serves the worker."""
        return await self._drain.run(timeout_s)

    # ------------------------------------------------------ asyncio side
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
            self._records.end(record, PrefillState.FAILED, TransferFailed(
                f"could not open a data channel to {target.decode_address}: {error}"))
            return None
        return opening.result()

    async def _abort(self, record: PrefillRecord) -> bool:
        if record.state is PrefillState.CONNECTING:  # moved only on this (asyncio) thread
            self._records.end(record, PrefillState.ABORTED, PrefillAborted(f"request {record.request_id} was aborted"))
            return True
        return await asyncio.wrap_future(self.loop.submit(lambda: self._runs.abort(record)))
