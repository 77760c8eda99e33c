"""Decode worker: reservation, KV arrival, decoding — one request's lifecycle.

    Decode RPC arrives
      -> reserve blocks for the prompt (less this worker's own prefix-cache hit)
         refused (no blocks / batch full)  -> RESOURCE_EXHAUSTED at once, marked no-room
                                              (proto.limits), nothing held
      -> TICKETED: ticket sent to the router, which asks a prefill worker to fill it
         KV arrives on the data channel    -> blocks imported, first token appended
         ticket deadline passes            -> ABORTED, blocks freed, stream ends "abort"
         transfer fails                    -> stays TICKETED (the router retries the prefill)
      -> DECODING: tokens stream back until stop/length
         client gone / Abort RPC           -> ABORTED, blocks freed
      -> FINISHED (terminal: finished, aborted)

All engine state is touched only on the ServingLoop thread; RPC handlers submit
commands and read an asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.serving_loop import ServingLoop
from kv_transfer.base import ChannelAddress, KVReceiver, ReceivedKV
from kv_transfer.packing import unpack_blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TicketInfo:
    ticket_id: int
    num_cached_tokens: int
    num_blocks: int


@dataclass
class _Pending:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float


class DecodeWorker:
    def __init__(self, core: EngineCore, receiver: KVReceiver, worker_id: str | None = None) -> None:
        self.core = core
        self.receiver = receiver
        self.worker_id = worker_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.loop = ServingLoop(core)
        self._pending: dict[int, _Pending] = {}
        self.transfers = 0
        """Received transfers, counted on the loop thread (with their bytes and seconds)."""
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.transfer_failures = 0

    def start(self) -> None:
        self.loop.start()
        self.loop.add_poll_hook(self._poll_transfers)

    def stop(self) -> None:
        self.loop.stop()
        self.receiver.close()

    # ------------------------------------------------------------ admission
    async def admit(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, ticket_timeout_s: float,
        local_prefill: bool = False,
    ) -> tuple[TicketInfo | None, asyncio.Queue[EngineCoreOutput]]:
        """Reserve blocks; on success outputs of the request go to the returned queue.
        local_prefill: queue the whole request here instead (ticket 0, nothing reserved)."""
        aio_loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()

        def sink(output: EngineCoreOutput) -> None:
            aio_loop.call_soon_threadsafe(outputs.put_nowait, output)

        def reserve() -> TicketInfo | None:
            request = Request(request_id, prompt, params, self.core.eos_token_ids)
            if local_prefill:
                self.core.add_request(request)
                self.loop.attach(request_id, sink)
                return TicketInfo(0, 0, 0)
            reservation = self.core.reserve_remote(request)
            if reservation is None:
                return None
            # Random 62-bit ids: a prefill worker serves many decode workers, so ids must be
            # unique across them without coordination (a counter per worker would collide).
            ticket_id = secrets.randbits(62) or 1
            while ticket_id in self._pending:
                ticket_id = secrets.randbits(62) or 1
            self._pending[ticket_id] = _Pending(
                request_id, reservation.block_ids, time.monotonic() + ticket_timeout_s
            )
            self.loop.attach(request_id, sink)
            return TicketInfo(ticket_id, reservation.num_cached_tokens, len(reservation.block_ids))

        try:
            ticket = await asyncio.wrap_future(self.loop.submit(reserve))
        except asyncio.CancelledError:
            # The caller left while the reservation ran: nobody will read the ticket, so free
            # now rather than at the ticket's deadline. Shielded: this task is being cancelled.
            await asyncio.shield(self.abort(request_id))
            raise
        return ticket, outputs

    async def abort(self, request_id: str) -> bool:
        def run() -> bool:
            for ticket_id, pending in list(self._pending.items()):
                if pending.request_id == request_id:
                    del self._pending[ticket_id]
            aborted = self.core.abort([request_id])
            for request in aborted:
                self.loop.deliver(EngineCoreOutput(request.request_id, (), None, "abort", None))
            self.loop.detach(request_id)
            return bool(aborted)

        return await asyncio.wrap_future(self.loop.submit(run))

    def open_channel(self) -> ChannelAddress:
        return self.receiver.open_channel()

    # ------------------------------------------------------- loop thread only
    def _poll_transfers(self) -> None:
        """Import every arrived transfer, each on its own: one that fails (a bad payload, an
        aborted request) fails only its own request and never hides the others in the batch."""
        for received in self.receiver.poll():
            try:
                self._on_received(received)
            except Exception:
                logger.exception("importing the KV of ticket %d failed", received.header.ticket_id)
                if received.header.ticket_id in self._pending:
                    self._fail(received.header.ticket_id, "importing its KV failed")
        now = time.monotonic()
        for ticket_id, pending in list(self._pending.items()):
            if pending.deadline < now:
                logger.warning("ticket %d (%s) expired before its KV arrived", ticket_id, pending.request_id)
                self._fail(ticket_id, "ticket expired")

    def _on_received(self, received: ReceivedKV) -> None:
        ticket_id = received.header.ticket_id
        pending = self._pending.get(ticket_id)
        if pending is None:
            logger.warning("KV for unknown or expired ticket %d dropped", ticket_id)
            if received.payload is not None:
                self.receiver.recycle(received.payload)
            return
        if received.payload is None:
            # Keep the reservation: the router retries the prefill elsewhere with the same
            # ticket; if nobody fills it, the deadline frees it.
            self.transfer_failures += 1
            logger.warning("KV transfer for ticket %d failed: %s", ticket_id, received.result.error)
            return
        if received.header.num_blocks != len(pending.block_ids):
            self.receiver.recycle(received.payload)
            self._fail(ticket_id, f"got {received.header.num_blocks} blocks, reserved {len(pending.block_ids)}")
            return
        del self._pending[ticket_id]
        unpack_blocks(received.payload, self.core.kv_caches, pending.block_ids)
        self.receiver.recycle(received.payload)  # copied into blocks: D may receive into it again
        self.transfers += 1
        self.transfer_bytes += received.result.nbytes
        self.transfer_seconds += received.result.seconds
        output = self.core.commit_remote(pending.request_id, received.header.first_token_id)
        if output is not None:
            self.loop.deliver(output)

    def _fail(self, ticket_id: int, reason: str) -> None:
        pending = self._pending.pop(ticket_id)
        logger.warning("request %s aborted: %s", pending.request_id, reason)
        for request in self.core.abort([pending.request_id]):
            self.loop.deliver(EngineCoreOutput(request.request_id, (), None, "abort", None))
