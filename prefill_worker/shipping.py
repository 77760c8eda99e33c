"""KVShipper: a prefilled request's KV on its way to the decode worker (engine loop thread only).

At the first token a request's blocks leave by one of two paths: its layer stream, opened
during the last chunk's forward pass (layer_stream.py), is finished; or, where no stream
carries all its blocks, they are packed and queued whole on the channel. Either way the blocks
are released at once (the feed or the payload holds copies) and the record is SENDING until
the channel reports the transfer's end, which settles the caller (SENT, or FAILED / ABORTED).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from engine.core import EngineCore
from engine.scheduler import EngineCoreOutput
from kv_transfer.base import ChannelAddress, TransferResult, TransferState
from kv_transfer.packing import make_header, pack_blocks
from kv_transfer.pool import ChannelPool
from prefill_worker.layer_stream import LayerStreams
from prefill_worker.records import PrefillRecords
from prefill_worker.states import DecodeTarget, PrefillRecord, PrefillResult, PrefillState, Shipment, TransferFailed
from worker_runtime.status import TransferTotals

logger = logging.getLogger(__name__)

ForgetChannel = Callable[[tuple[str, str]], None]
"""Drops the channel of (decode address, incarnation) so the next request opens a new one."""


class KVShipper:
    def __init__(self, core: EngineCore, channels: ChannelPool, records: PrefillRecords,
                 layers: LayerStreams | None, forget_channel: ForgetChannel) -> None:
        self._core = core
        self._channels = channels
        self._records = records
        self._layers = layers
        self._forget_channel = forget_channel
        self.totals = TransferTotals()
        """Finished and failed transfers so far (replaced whole, so any thread may read it)."""

    def ship(self, record: PrefillRecord, first: EngineCoreOutput, address: ChannelAddress,
             target: DecodeTarget) -> None:
        """Send the request's KV (its blocks released here); a failure fails this request only."""
        try:
            if not self._finish_stream(record, first, target):
                self._send(record, first, address, target)
        except Exception as exc:  # this request fails; the loop and the others go on
            logger.exception("sending the KV of %s failed", record.request_id)
            self._core.release_blocks(record.request_id)
            if not record.ended:
                self._records.end(record, PrefillState.FAILED, TransferFailed(f"could not send the KV: {exc}"))

    def _send(self, record: PrefillRecord, first: EngineCoreOutput, address, target: DecodeTarget) -> None:
        """Pack and queue the request's blocks; they are released here whatever happens next."""
        try:
            block_size = self._core.config.block_size
            block_ids = self._core.held_block_ids(record.request_id)[target.num_cached_tokens // block_size:]
            payload = pack_blocks(self._core.kv_caches, block_ids)
        finally:
            self._core.release_blocks(record.request_id)  # pack_blocks copied them (or failed)
        if payload.shape[2] != target.num_blocks:
            self._records.end(record, PrefillState.FAILED, TransferFailed(
                f"ticket {target.ticket_id}: decode reserved {target.num_blocks} blocks, prompt has "
                f"{payload.shape[2]} after its cached prefix"))
            return
        sender = self._channels.get(address)
        if sender is None:
            self._records.end(record, PrefillState.FAILED, TransferFailed(f"no channel to {target.decode_address}"))
            return
        try:
            sender.send(make_header(target.ticket_id, first.new_token_ids[0], payload, first.sampled_at),
                        payload.contiguous())
        except Exception as exc:  # a closed sender, a ticket still outstanding: this request only
            self._records.end(record, PrefillState.FAILED,
                              TransferFailed(f"could not send ticket {target.ticket_id}: {exc}"))
            return
        self._shipped(record, first, payload.shape[2], target)

    def _finish_stream(self, record: PrefillRecord, first: EngineCoreOutput, target: DecodeTarget) -> bool:
        """Finish the request's layer stream, if one carries all its blocks; True then (its
        blocks released: every layer was copied into the feed during the step)."""
        if self._layers is None:
            return False
        block_size = self._core.config.block_size
        held = self._core.held_block_ids(record.request_id)[target.num_cached_tokens // block_size:]
        feed = self._layers.take(record.request_id, held)
        if feed is None:
            return False
        self._core.release_blocks(record.request_id)
        feed.finish(first.new_token_ids[0], first.sampled_at)
        self._shipped(record, first, feed.header.num_blocks, target)
        return True

    def _shipped(self, record: PrefillRecord, first: EngineCoreOutput, num_blocks: int, target: DecodeTarget) -> None:
        record.shipment = Shipment(first, num_blocks, (target.decode_address, target.incarnation))
        self._records.sent_on(record, target.ticket_id)
        self._records.move(record, PrefillState.SENDING)

    # ------------------------------------------------------ transfer results
    def poll_transfers(self) -> None:
        """Settle every finished transfer's request; each is handled on its own, so a request
        whose client left (its future cancelled) never hides the results polled with it."""
        for result in self._channels.poll():
            record = self._records.sending(result.ticket_id)
            if record is None or record.ended:
                continue
            try:
                self._finish_transfer(record, result)
            except Exception:
                logger.exception("settling the transfer of %s failed", record.request_id)
                if not record.ended:
                    self._records.end(record, PrefillState.FAILED,
                                      TransferFailed("internal error while finishing the transfer"))

    def _finish_transfer(self, record: PrefillRecord, result: TransferResult) -> None:
        shipment = record.shipment
        assert shipment is not None, f"SENDING record {record.request_id} has no shipment"
        if result.state is TransferState.FAILED:
            # The channel is gone; the next request to that decode worker opens a new one.
            self._forget_channel(shipment.channel_key)
            self.totals = replace(self.totals, failures=self.totals.failures + 1)
            state = PrefillState.ABORTED if record.abandoned else PrefillState.FAILED
            self._records.end(record, state, TransferFailed(result.error or "transfer failed"))
            return
        t = self.totals
        self.totals = TransferTotals(t.count + 1, t.nbytes + result.nbytes, t.seconds + result.seconds, t.failures)
        if record.abandoned:
            self._records.move(record, PrefillState.ABORTED, "the client left while its KV was on the wire")
            return
        queue_s, compute_s = record.timing.split()
        self._records.end(record, PrefillState.SENT, result=PrefillResult(
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
