"""The `Worker` protocol every role implements, and the frozen status it reports.

Servicers, heartbeats and metrics read a worker only through `status()`: a frozen snapshot,
safe to take on any thread, never a live handle into the engine loop.

A worker process's lifecycle (each request inside it has its own, named in its worker module):

    STARTING  model loading, not registered
      -> SERVING   registered; takes new work
      -> DRAINING  still registered (marked draining: routers send nothing new); refuses new
                   work; in-flight requests finish, or end with an explicit error past the
                   drain timeout
      -> STOPPED   nothing in flight, no block held; the process exits
    (terminal: STOPPED)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from engine.core import CoreStats


class WorkerState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


TERMINAL_WORKER_STATES = frozenset({WorkerState.STOPPED})


@dataclass(frozen=True)
class TransferTotals:
    """KV transfers since start: sent (prefill) or received (decode)."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    failures: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    incarnation: str
    role: str
    """"prefill" or "decode"."""
    state: WorkerState
    block_size: int
    """Tokens per KV block."""
    max_model_len: int
    core: CoreStats
    """Blocks and requests of the engine, as the loop thread last refreshed them."""
    in_flight: int
    """Requests this worker still owes an answer: drained when 0."""
    transfers: TransferTotals


@dataclass(frozen=True)
class DrainResult:
    finished: int
    """In-flight requests that completed during the drain."""
    aborted: int
    """Requests still in flight at the timeout, ended with an explicit error."""
    seconds: float


@runtime_checkable
class Worker(Protocol):
    """One prefill or decode worker (prefill_worker.worker.PrefillWorker,
    decode_worker.worker.DecodeWorker)."""

    role: ClassVar[str]
    worker_id: str
    incarnation: str

    def start(self) -> None:
        """Start the engine loop thread. Not blocking beyond the thread start."""

    def stop(self) -> None:
        """Stop the loop and close the data channels (after a drain, or at once)."""

    def status(self) -> WorkerStatus:
        """A frozen snapshot; any thread; never blocks on the engine loop."""

    def begin_drain(self) -> bool:
        """Refuse new work from now on (new Decode/Prefill calls fail UNAVAILABLE so the router
        tries another worker). Idempotent; True on the first call. Any thread."""

    async def drain(self, timeout_s: float) -> DrainResult:
        """begin_drain(), then wait until nothing is in flight, at most timeout_s; requests
        still in flight then end with an explicit error and their blocks are freed. On return
        the worker holds no block and owes no transfer (a prefill's queued sends finished or
        failed). Call on the asyncio loop that serves the worker."""
