"""PrefillDrain: a prefill worker's drain — refuse new calls, wait for those in flight, then
end what is left within bounded waits (the worker and its blocks end clean either way)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.serving_loop import ServingLoop, wait_until_async
from prefill_worker.records import PrefillRecords
from prefill_worker.runs import PrefillRuns
from prefill_worker.states import PrefillDrained, PrefillRecord, PrefillState, TransferFailed
from worker_runtime.status import DrainResult

logger = logging.getLogger(__name__)

LOOP_COMMAND_TIMEOUT_S = 30.0
"""Longest a drain waits for the engine loop to run one of its commands (one engine step
plus the command; far above any step on the models we serve)."""


class PrefillDrain:
    def __init__(self, worker_id: str, records: PrefillRecords, loop: ServingLoop, runs: PrefillRuns,
                 transfer_timeout_s: float) -> None:
        self._worker_id = worker_id
        self._records = records
        self._loop = loop
        self._runs = runs
        self._transfer_timeout_s = transfer_timeout_s

    def begin(self) -> bool:
        """Refuse new Prefill calls from now on (PrefillDraining). Idempotent; True the first
        time. Any thread."""
        if not self._records.close():
            return False
        # debug: the process hosting the worker logs its drain (worker_runtime/process.py)
        logger.debug("prefill worker %s draining, %d in flight", self._worker_id, len(self._records))
        return True

    async def run(self, timeout_s: float) -> DrainResult:
        """begin(), wait (at most timeout_s) until nothing is in flight, then fail what is
        left: calls not yet on the wire at once (PrefillDrained, UNAVAILABLE), transfers on the
        wire after the transport's own bounded wait. On return no record is left and no block
        is held. Call on the asyncio loop that serves the worker."""
        started = time.monotonic()
        self.begin()
        before = len(self._records)
        cut = 0
        if not await wait_until_async(lambda: len(self._records) == 0, timeout_s):
            cut = await self._cut(timeout_s)
        result = DrainResult(finished=max(before - cut, 0), aborted=cut, seconds=time.monotonic() - started)
        logger.debug("prefill worker %s drained: %d finished, %d ended by the %g s timeout, %.2f s",
                     self._worker_id, result.finished, result.aborted, timeout_s, result.seconds)
        return result

    async def _on_loop(self, command: Callable[[], int]) -> int:
        """Run a drain's command on the engine loop, bounded: a wedged loop must not hang the
        drain (asyncio.TimeoutError then; the process exits anyway)."""
        return await asyncio.wait_for(asyncio.wrap_future(self._loop.submit(command)), LOOP_COMMAND_TIMEOUT_S)

    async def _cut(self, timeout_s: float) -> int:
        """End what a drain timed out on; the number ended."""
        def drained(record: PrefillRecord) -> PrefillDrained:
            return PrefillDrained(f"prefill worker {self._worker_id} drained: request {record.request_id} "
                                  f"({record.state.name}) ended after the {timeout_s:g} s drain timeout")

        cut = 0
        for record in self._records.all():
            if record.state is PrefillState.CONNECTING:  # moved only on this (asyncio) thread
                self._records.end(record, PrefillState.FAILED, drained(record))
                cut += 1
        cut += await self._on_loop(lambda: self._runs.cut_unsent(drained))
        # Transfers already on the wire: the transport ends each within its own timeout (a
        # header, a payload and an ack, each bounded by transfer_timeout_s).
        bound = 3 * self._transfer_timeout_s + 1.0
        if not await wait_until_async(lambda: len(self._records) == 0, bound):
            cut += await self._on_loop(lambda: self._cut_sending(bound))
        return cut

    def _cut_sending(self, bound: float) -> int:
        """Loop thread: the transport broke its own timeout; give up on its transfers."""
        cut = 0
        for record in self._records.all():
            if record.state is PrefillState.SENDING:
                logger.error("ticket %d of %s still unsent %g s after the drain timeout",
                             record.ticket_id, record.request_id, bound)
                state = PrefillState.ABORTED if record.abandoned else PrefillState.FAILED
                self._records.end(record, state, TransferFailed(f"ticket {record.ticket_id} unsent after {bound:g} s"))
                cut += 1
        return cut
