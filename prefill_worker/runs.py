"""PrefillRuns: a request's time in the prefill engine (engine loop thread only).

QUEUED (added to the engine, its first token awaited) -> COMPUTING (a chunk computed) -> the
first token hands it to the KVShipper. Aborts and a drain's cut end it here too, wherever it
is in the engine, with its blocks freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.serving_loop import ServingLoop
from kv_transfer.base import ChannelAddress
from prefill_worker.layer_stream import LayerStreams
from prefill_worker.records import PrefillRecords
from prefill_worker.shipping import KVShipper
from prefill_worker.states import (
    DecodeTarget, PrefillAborted, PrefillDrained, PrefillRecord, PrefillState, prefill_params, settle,
)


class PrefillRuns:
    def __init__(self, core: EngineCore, loop: ServingLoop, records: PrefillRecords,
                 layers: LayerStreams | None, shipper: KVShipper) -> None:
        self._core = core
        self._loop = loop
        self._records = records
        self._layers = layers
        self._shipper = shipper

    def queue(self, record: PrefillRecord, prompt, params: SamplingParams, address: ChannelAddress,
              target: DecodeTarget) -> None:
        """Add the request to the engine; a prompt the engine refuses fails it (ValueError)."""
        if record.ended:
            return
        self._loop.attach(record.request_id, lambda output: self._on_first_token(record, output, address, target))
        try:
            self._core.add_request(Request(record.request_id, prompt, prefill_params(params),
                                           self._core.eos_token_ids))
        except ValueError as exc:  # too long, or the id is still in the engine
            self._loop.detach(record.request_id)
            self._records.end(record, PrefillState.FAILED, exc)
            return
        self._records.watch_queued(record)
        if self._layers is not None:
            self._layers.want(record.request_id, address, target)

    def abort(self, record: PrefillRecord) -> bool:
        """End the request (its blocks freed); False when it had ended already."""
        if record.ended:
            return False
        self._loop.detach(record.request_id)
        self._core.abort([record.request_id])  # frees its blocks wherever they are (held ones too)
        error = PrefillAborted(f"request {record.request_id} was aborted")
        if record.state is not PrefillState.SENDING:
            self._records.end(record, PrefillState.ABORTED, error)
            return True
        self._records.abandon(record)  # on the wire: the transfer still ends (a drain waits)
        settle(record.future, error=error)
        return True

    def poll(self) -> None:
        """The loop's poll hook (just before each step)."""
        self._note_progress()
        self._shipper.poll_transfers()

    def cut_unsent(self, drained: Callable[[PrefillRecord], PrefillDrained]) -> int:
        """End QUEUED and COMPUTING records (their blocks freed); the number ended."""
        cut = 0
        for record in self._records.all():
            if record.state in (PrefillState.QUEUED, PrefillState.COMPUTING):
                self._loop.detach(record.request_id)
                self._core.abort([record.request_id])
                self._records.end(record, PrefillState.FAILED, drained(record))
                cut += 1
        return cut

    def _note_progress(self) -> None:
        """QUEUED -> COMPUTING once the engine has computed a chunk of the prompt; until then,
        stamp it as still waiting (this hook runs just before each step)."""
        now = time.monotonic()
        for record in self._records.queued():
            request = self._core.scheduler.requests.get(record.request_id)
            if request is not None and request.num_computed_tokens > 0:
                self._records.move(record, PrefillState.COMPUTING)
            else:
                record.timing.unscheduled_at = now

    def _on_first_token(self, record: PrefillRecord, output: EngineCoreOutput, address, target) -> None:
        record.timing.first_token()
        if record.ended:  # cannot happen while attached; never leave blocks behind
            self._core.release_blocks(record.request_id)
            return
        if not output.new_token_ids:  # the engine dropped it (a failed step)
            self._records.end(record, PrefillState.FAILED,
                              PrefillAborted(f"request {record.request_id} was aborted before its first token"))
            return
        self._shipper.ship(record, output, address, target)
