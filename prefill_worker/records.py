"""PrefillRecords: the prefill worker's records, the indexes over them, and whether it takes
new ones (the worker's state), behind one lock.

Why one object: every state change of a record must update the indexes a drain, an Abort and a
transfer result read, and acceptance must check the worker's state and add the record in one
step (a drain that begins on another thread either sees the record or refuses it). Moves happen
on the asyncio loop (CONNECTING) or the engine loop thread (later states); status() and a drain
read from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prefill_worker.states import TERMINAL, PrefillDraining, PrefillRecord, PrefillResult, PrefillState, move, settle
from worker_runtime.status import WorkerState

logger = logging.getLogger(__name__)

OnEnd = Callable[[str, str], None]
"""Called with (request id, reason) after a record reaches a terminal state."""


class PrefillRecords:
    def __init__(self, worker_id: str, on_end: OnEnd | None = None) -> None:
        self.worker_id = worker_id
        self._on_end = on_end
        self._lock = threading.Lock()
        """Guards the indexes below and the worker state (status() reads them on any thread)."""
        self.state = WorkerState.STARTING
        self._live: dict[int, PrefillRecord] = {}
        """Every non-terminal record (abandoned SENDING ones too): what a drain waits for."""
        self._by_request: dict[str, PrefillRecord] = {}
        """Records whose caller still waits, by request id (Abort looks here)."""
        self._by_ticket: dict[int, PrefillRecord] = {}
        """SENDING records by ticket id (transfer results name the ticket)."""
        self._queued: dict[int, PrefillRecord] = {}
        """QUEUED records, watched for their first computed chunk (loop thread only)."""

    # -------------------------------------------------------- worker state
    def serve(self) -> None:
        """STARTING -> SERVING (a worker already draining or stopped stays so)."""
        with self._lock:
            if self.state is WorkerState.STARTING:
                self.state = WorkerState.SERVING

    def close(self) -> bool:
        """Take no new records from now on (DRAINING); True the first time. Any thread."""
        with self._lock:
            if self.state in (WorkerState.DRAINING, WorkerState.STOPPED):
                return False
            self.state = WorkerState.DRAINING
        return True

    def stopped(self) -> None:
        with self._lock:
            self.state = WorkerState.STOPPED

    # ------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._live)

    def all(self) -> tuple[PrefillRecord, ...]:
        """The live records now (read them, never write)."""
        with self._lock:
            return tuple(self._live.values())

    def waiting(self, request_id: str) -> PrefillRecord | None:
        """The record whose caller still waits under this request id."""
        return self._by_request.get(request_id)

    def sending(self, ticket_id: int) -> PrefillRecord | None:
        """The SENDING record of this ticket."""
        return self._by_ticket.get(ticket_id)

    def queued(self) -> list[PrefillRecord]:
        """QUEUED records (loop thread only)."""
        return list(self._queued.values())

    # ------------------------------------------------------------- writing
    def accept(self, request_id: str, ticket_id: int) -> PrefillRecord:
        """A new CONNECTING record. Raises PrefillDraining when draining or stopped, ValueError
        for a request id already in flight."""
        with self._lock:
            if self.state in (WorkerState.DRAINING, WorkerState.STOPPED):
                raise PrefillDraining(
                    f"prefill worker {self.worker_id} is {self.state.value}: it takes no new requests")
            if request_id in self._by_request:
                raise ValueError(f"request id {request_id!r} is already in flight on {self.worker_id}")
            record = PrefillRecord(request_id, ticket_id)
            self._live[record.key] = record
            self._by_request[request_id] = record
        return record

    def watch_queued(self, record: PrefillRecord) -> None:
        """Watch a QUEUED record for its first computed chunk (loop thread only)."""
        self._queued[record.key] = record

    def sent_on(self, record: PrefillRecord, ticket_id: int) -> None:
        """Index a record whose KV is going on the wire under this ticket."""
        with self._lock:
            self._by_ticket[ticket_id] = record

    def abandon(self, record: PrefillRecord) -> None:
        """The caller left while the KV is on the wire: the transfer still ends (a drain waits
        for it), nobody is told."""
        with self._lock:
            record.abandoned = True
            if self._by_request.get(record.request_id) is record:
                del self._by_request[record.request_id]

    def move(self, record: PrefillRecord, new: PrefillState, reason: str = "") -> None:
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
        if new in TERMINAL and self._on_end is not None:
            self._on_end(record.request_id, reason or new.name)
        logger.debug("prefill %s -> %s %s", record.request_id, new.name, reason)

    def end(self, record: PrefillRecord, state: PrefillState, error: BaseException | None = None,
            result: PrefillResult | None = None) -> None:
        """Move to a terminal state and answer the caller (if it still waits)."""
        self.move(record, state, str(error) if error is not None else "")
        settle(record.future, result, error)
