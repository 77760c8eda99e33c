"""What a backend saw of one backend request's path, for its per-request timeline.

A backend that can tell where a request's time went creates one `BackendTrace` per backend
request, hands it to the router on the request's first `TokenDelta`, and keeps filling it as
the request goes on (the prefill reply may come after the first token when the decode worker
streams it early). The run reads it once, when the client request ends. It never crosses a
process: it is written and read on the router's event loop only.

Times are `time.monotonic()` seconds (the run converts them to milliseconds since arrival).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.ops.timeline import RouteSummary, TransferSummary

BACKEND_MARKS = ("backend_start", "reserve_start", "ticket", "first_token")
"""The backend's boundaries, in order: its start (admission begins), the Decode call that got
the reservation, the ticket, and the first token in the router's hands."""


@dataclass
class BackendTrace:
    """Filled by the backend while its request runs; read by the run when the request ends."""

    clock: Callable[[], float] = time.monotonic
    marks: dict[str, float] = field(default_factory=dict)
    """Name (BACKEND_MARKS) -> clock time; a mark is set once, the first time it is reached."""
    route: RouteSummary | None = None
    transfer: TransferSummary | None = None
    queue_s: float = 0.0
    """Seconds in the router's admission queue (inside the admission_wait phase)."""
    reserve: dict[str, float | str] = field(default_factory=dict)
    """Detail of the reservation: decode worker, cached prompt tokens, blocks reserved."""
    prefill: dict[str, float | str] = field(default_factory=dict)
    """Detail of the prefill: worker, attempts, its worker-side queue/compute seconds, where the
    first token came from ("stream" or "prefill_reply"), the Prefill RPC's own duration."""

    def mark(self, name: str) -> None:
        assert name in BACKEND_MARKS, f"unknown backend mark {name!r}"
        self.marks.setdefault(name, self.clock())
