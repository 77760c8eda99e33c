"""The states of one request on a decode worker, the moves allowed between them, and the
record the worker keeps per request (the diagram is in decode_worker/worker.py).

Every record is created and moved on the engine loop thread only, so a wrong move is a bug:
`move` asserts. (The loop sees KV whole: the import thread writes it into the blocks and
reports it once complete, so there is no separate "receiving" state to observe.)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.scheduler import EngineCoreOutput


class DecodeState(enum.Enum):
    TICKETED = "ticketed"
    """Blocks reserved for the prompt; a prefill worker is filling them (or will be)."""
    DECODING = "decoding"
    """In the decode batch (KV imported, or a local prefill computing here)."""
    FINISHED = "finished"
    """Stopped or reached its length; the stream ended with its finish_reason."""
    ABORTED = "aborted"
    """The router went away, or asked for it with Abort."""
    EXPIRED = "expired"
    """Its ticket's deadline passed before the KV arrived; the stream ended "abort"."""
    FAILED = "failed"
    """The worker could not go on with it: a bad payload, a failed engine step, or a drain
    that timed out (then the stream ends with an UNAVAILABLE error, never silently)."""


TERMINAL = frozenset({DecodeState.FINISHED, DecodeState.ABORTED, DecodeState.EXPIRED, DecodeState.FAILED})
INITIAL = frozenset({DecodeState.TICKETED, DecodeState.DECODING})
"""TICKETED for a disaggregated request, DECODING for one prefilled here (local_prefill)."""

TRANSITIONS: dict[DecodeState, frozenset[DecodeState]] = {
    DecodeState.TICKETED: frozenset({DecodeState.DECODING, DecodeState.ABORTED, DecodeState.EXPIRED,
                                     DecodeState.FAILED}),
    DecodeState.DECODING: frozenset({DecodeState.FINISHED, DecodeState.ABORTED, DecodeState.FAILED}),
    DecodeState.FINISHED: frozenset(),
    DecodeState.ABORTED: frozenset(),
    DecodeState.EXPIRED: frozenset(),
    DecodeState.FAILED: frozenset(),
}


class DecodeDraining(RuntimeError):
    """A new Decode call reached a draining (or stopped) worker (gRPC UNAVAILABLE: the router
    tries the next decode worker)."""


class StreamFailed(RuntimeError):
    """Put on a request's output queue instead of an output: its Decode stream ends with this
    error (gRPC UNAVAILABLE), e.g. when a drain timed out with the request in flight."""


StreamItem = EngineCoreOutput | StreamFailed
"""What a request's output queue carries."""


@dataclass(eq=False)
class DecodeRecord:
    """One Decode call the worker holds, from admission until a terminal state."""

    request_id: str
    state: DecodeState
    emit: Callable[[StreamItem], None]
    """Puts an item on the caller's queue (thread-safe; never blocks)."""
    ticket_id: int | None = None
    """None for a local prefill."""
    block_ids: tuple[int, ...] = ()
    """The reserved blocks the KV is unpacked into."""
    deadline: float = 0.0
    """time.monotonic() past which an unfilled ticket expires."""
    history: list[DecodeState] = field(default_factory=list)
    """Every state it has been in, in order (for logs and tests)."""
    reason: str = ""
    """Why it ended, for ABORTED, EXPIRED and FAILED."""
    stream_first_token: bool = False
    """The caller wants the prefill's first token streamed as soon as its KV is in."""

    def __post_init__(self) -> None:
        assert self.state in INITIAL, f"decode request {self.request_id} cannot start {self.state.name}"
        self.history.append(self.state)

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL


def move(record: DecodeRecord, new: DecodeState, reason: str = "") -> None:
    """The one way a record changes state; an illegal move is a bug (AssertionError)."""
    assert new in TRANSITIONS[record.state], (
        f"decode request {record.request_id}: illegal move {record.state.name} -> {new.name} "
        f"(history {[s.name for s in record.history]})")
    record.state = new
    record.history.append(new)
    if reason:
        record.reason = reason
