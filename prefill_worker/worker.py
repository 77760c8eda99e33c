"""Prefill worker: one request's lifecycle.

    Prefill RPC arrives with a ticket from a decode worker
      -> QUEUED: the prompt waits for the engine (chunked with other prompts)
      -> COMPUTED: first token sampled; the blocks stay held (not freed at finish)
      -> SENDING: blocks after the decode worker's cached prefix are packed and queued on
         the channel to that decode worker (opened once per decode worker, pooled)
      -> SENT: the transfer finished; blocks released; the first token is returned
         transfer failed  -> blocks released; the RPC fails UNAVAILABLE (router retries)
         client gone      -> aborted wherever it is; blocks released. Gone while SENDING:
                             the blocks were already copied out and released; the transfer's
                             entry is dropped when its result is polled, and nobody is told
      (terminal: sent, failed, aborted)

All engine state is touched only on the ServingLoop thread. A request's future may be cancelled
by its RPC at any moment (asyncio.wrap_future cancels it when the client leaves), so the loop
thread settles futures only through `_settle`, and one request's failure never stops the loop
from settling the others in the same batch of transfer results.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from engine.core import EngineCore
from engine.request import Request
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.serving_loop import ServingLoop
from kv_transfer.base import ChannelAddress, TransferState
from kv_transfer.packing import make_header, pack_blocks
from kv_transfer.pool import ChannelPool

logger = logging.getLogger(__name__)

ChannelOpener = Callable[[str], Awaitable[ChannelAddress]]
"""Asks the decode worker at a gRPC address to open a data channel for us."""


class TransferFailed(RuntimeError):
    pass


class PrefillAborted(TransferFailed):
    """The engine dropped the request (a failed step, a shutdown) before its first token."""


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> bool:
    """Set `future` unless it is already done (cancelled by a departed client, or settled);
    True when this call settled it. Concurrent futures raise InvalidStateError otherwise."""
    if future.done():
        return False
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:  # cancelled between the check and the set (another thread)
        return False
    return True


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    num_cached_tokens: int
    nbytes: int
    seconds: float
    num_blocks: int


@dataclass(frozen=True)
class DecodeTarget:
    """Where a prefill's KV must go (from the decode worker's ticket)."""

    decode_address: str
    incarnation: str
    ticket_id: int
    num_cached_tokens: int
    num_blocks: int


@dataclass
class _InFlight:
    request_id: str
    future: Future
    first: EngineCoreOutput
    num_cached_tokens: int
    num_blocks: int
    started: float
    channel_key: tuple[str, str]


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill computes exactly the first token: same sampling, one token, no stops."""
    return replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=(),
                   stop_token_ids=params.stop_token_ids)


class PrefillWorker:
    def __init__(self, core: EngineCore, channels: ChannelPool, open_channel: ChannelOpener,
                 worker_id: str | None = None, backend_name: str = "gloo") -> None:
        assert core.scheduler.hold_finished_blocks, "a prefill worker's core must hold finished blocks"
        self.core = core
        self.channels = channels
        self.backend_name = backend_name
        self._open_channel = open_channel
        self.worker_id = worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.loop = ServingLoop(core)
        self._addresses: dict[tuple[str, str], asyncio.Future[ChannelAddress]] = {}
        """One OpenChannel per decode worker incarnation, shared by concurrent requests."""
        self._in_flight: dict[int, _InFlight] = {}
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.transfers = 0

    def start(self) -> None:
        self.loop.start()
        self.loop.add_poll_hook(self._poll_transfers)

    def stop(self) -> None:
        self.loop.stop()
        self.channels.close()

    async def prefill(
        self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, target: DecodeTarget
    ) -> PrefillResult:
        """Compute the prompt, push its KV to the target, return the first token.
        Raises TransferFailed when the KV could not be delivered."""
        address = await self._channel(target)
        done: Future = Future()

        def sink(output: EngineCoreOutput) -> None:
            if not output.new_token_ids:  # aborted by the engine
                _settle(done, error=PrefillAborted(f"request {request_id} was aborted before its first token"))
                return
            try:
                self._send(request_id, output, address, target, done)
            except Exception as exc:  # this request fails; the loop and the others go on
                logger.exception("sending the KV of %s failed", request_id)
                _settle(done, error=TransferFailed(f"could not send the KV: {exc}"))

        def add() -> None:
            self.loop.attach(request_id, sink)
            self.core.add_request(Request(request_id, prompt, prefill_params(params), self.core.eos_token_ids))

        try:
            await asyncio.wrap_future(self.loop.submit(add))
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # Shielded: the abort must reach the loop even though this task is being cancelled.
            await asyncio.shield(self.abort(request_id))
            raise

    async def abort(self, request_id: str) -> bool:
        def run() -> bool:
            self.loop.detach(request_id)
            return bool(self.core.abort([request_id]))

        return await asyncio.wrap_future(self.loop.submit(run))

    async def _channel(self, target: DecodeTarget) -> ChannelAddress:
        key = (target.decode_address, target.incarnation)
        opening = self._addresses.get(key)
        if opening is None:
            opening = self._addresses[key] = asyncio.ensure_future(self._open_channel(target.decode_address))
        try:
            return await asyncio.shield(opening)
        except Exception:
            if self._addresses.get(key) is opening:
                del self._addresses[key]  # the next request tries again
            raise

    # ------------------------------------------------------- loop thread only
    def _send(self, request_id, first: EngineCoreOutput, address, target: DecodeTarget, done: Future) -> None:
        """Pack and queue the request's blocks; they are released here whatever happens next."""
        try:
            block_size = self.core.config.block_size
            block_ids = self.core.held_block_ids(request_id)[target.num_cached_tokens // block_size:]
            payload = pack_blocks(self.core.kv_caches, block_ids)
        finally:
            self.core.release_blocks(request_id)  # pack_blocks copied them (or failed)
        if done.done():  # the client left while the prompt was computed: nothing to send
            return
        if payload.shape[2] != target.num_blocks:
            _settle(done, error=TransferFailed(
                f"ticket {target.ticket_id}: decode reserved {target.num_blocks} blocks, prompt has "
                f"{payload.shape[2]} after its cached prefix"))
            return
        sender = self.channels.get(address)
        if sender is None:
            _settle(done, error=TransferFailed(f"no channel to {target.decode_address}"))
            return
        header = make_header(target.ticket_id, first.new_token_ids[0], payload)
        try:
            sender.send(header, payload.contiguous())
        except Exception as exc:  # a closed sender, a ticket still outstanding: this request only
            _settle(done, error=TransferFailed(f"could not send ticket {target.ticket_id}: {exc}"))
            return
        self._in_flight[target.ticket_id] = _InFlight(
            request_id, done, first, first.num_cached_tokens, payload.shape[2], time.perf_counter(),
            (target.decode_address, target.incarnation))

    def _poll_transfers(self) -> None:
        """Settle every finished transfer's request; each is handled on its own, so a request
        whose client left (its future cancelled) never hides the results polled with it."""
        for result in self.channels.poll():
            flight = self._in_flight.pop(result.ticket_id, None)
            if flight is None:
                continue
            try:
                self._finish_transfer(flight, result)
            except Exception:
                logger.exception("settling the transfer of %s failed", flight.request_id)
                _settle(flight.future, error=TransferFailed("internal error while finishing the transfer"))

    def _finish_transfer(self, flight: _InFlight, result) -> None:
        if result.state is TransferState.FAILED:
            # The channel is gone; the next request to that decode worker opens a new one.
            self._addresses.pop(flight.channel_key, None)
            _settle(flight.future, error=TransferFailed(result.error or "transfer failed"))
            return
        self.transfers += 1
        self.transfer_bytes += result.nbytes
        self.transfer_seconds += result.seconds
        _settle(flight.future, PrefillResult(
            first_token_id=flight.first.new_token_ids[0],
            first_logprobs=flight.first.logprobs,
            num_cached_tokens=flight.num_cached_tokens,
            nbytes=result.nbytes,
            seconds=result.seconds,
            num_blocks=flight.num_blocks,
        ))
