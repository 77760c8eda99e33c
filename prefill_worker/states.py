"""The states of one request on a prefill worker, the moves allowed between them, and the
record the worker keeps per request (the diagram is in prefill_worker/worker.py).

A wrong move is a bug in the worker, so `move` asserts; a path that may legitimately find its
request already ended (the client left first) checks `record.ended` before moving.
"""

from __future__ import annotations

import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput


class PrefillState(enum.Enum):
    CONNECTING = "connecting"
    """The data channel to the ticket's decode worker is being opened (asyncio side)."""
    QUEUED = "queued"
    """Handed to the engine loop; no prompt token computed yet."""
    COMPUTING = "computing"
    """Prompt chunks are running (a long prompt takes several steps)."""
    SENDING = "sending"
    """First token sampled, blocks packed and released, payload queued on the channel."""
    SENT = "sent"
    """The decode worker has the KV; the first token was returned."""
    FAILED = "failed"
    """Could not be delivered (channel, transfer, engine, drain timeout): the call fails."""
    ABORTED = "aborted"
    """The client left or the router aborted it."""


TERMINAL = frozenset({PrefillState.SENT, PrefillState.FAILED, PrefillState.ABORTED})

_ENDINGS = frozenset({PrefillState.FAILED, PrefillState.ABORTED})
TRANSITIONS: dict[PrefillState, frozenset[PrefillState]] = {
    PrefillState.CONNECTING: frozenset({PrefillState.QUEUED}) | _ENDINGS,
    # QUEUED -> SENDING: a prompt that fits one step is computed before the loop looks again.
    PrefillState.QUEUED: frozenset({PrefillState.COMPUTING, PrefillState.SENDING}) | _ENDINGS,
    PrefillState.COMPUTING: frozenset({PrefillState.SENDING}) | _ENDINGS,
    PrefillState.SENDING: frozenset({PrefillState.SENT}) | _ENDINGS,
    PrefillState.SENT: frozenset(),
    PrefillState.FAILED: frozenset(),
    PrefillState.ABORTED: frozenset(),
}

_serial = itertools.count(1)


class PrefillDraining(RuntimeError):
    """A new Prefill call reached a draining (or stopped) worker (gRPC UNAVAILABLE: the router
    tries the next prefill worker)."""


class TransferFailed(RuntimeError):
    """The KV could not be delivered to the decode worker (gRPC UNAVAILABLE)."""


class PrefillAborted(TransferFailed):
    """The engine or an Abort RPC ended the request before its KV was delivered."""


class PrefillDrained(TransferFailed):
    """Still in flight when the worker's drain timed out."""


@dataclass(frozen=True)
class Shipment:
    """What a SENDING record needs when its transfer's result arrives."""

    first: EngineCoreOutput
    """The prefill's one output: the first token (and its logprobs)."""
    num_blocks: int
    channel_key: tuple[str, str]
    """(decode address, incarnation): the channel to forget if the transfer fails."""


@dataclass
class PrefillTimes:
    """Stamps of one prefill on this worker (engine loop thread after acceptance). The engine
    does not say when it schedules a request's first chunk; the poll hook runs just before each
    step, so the last time it saw the request uncomputed bounds that chunk's start."""

    accepted_at: float = field(default_factory=time.monotonic)
    unscheduled_at: float | None = None
    """time.monotonic() when the loop last saw it waiting for its first chunk."""
    first_token_at: float | None = None
    """time.monotonic() at its first token."""
    first_token_unix: float = 0.0

    def first_token(self) -> None:
        self.first_token_at, self.first_token_unix = time.monotonic(), time.time()

    def split(self) -> tuple[float, float]:
        """(queue_s, compute_s): acceptance -> first chunk, first chunk -> first token."""
        end = self.first_token_at if self.first_token_at is not None else time.monotonic()
        start = self.unscheduled_at if self.unscheduled_at is not None else self.accepted_at
        start = min(max(start, self.accepted_at), end)
        return start - self.accepted_at, end - start


@dataclass(eq=False)
class PrefillRecord:
    """One Prefill call the worker holds, from acceptance until a terminal state.

    Threads: CONNECTING records are moved only on the asyncio loop; from QUEUED on, only on
    the engine loop thread. `future` is settled (from either) through `settle` below, so a
    departed client's cancelled future never breaks the settling thread.
    """

    request_id: str
    ticket_id: int
    future: Future = field(default_factory=Future)
    state: PrefillState = PrefillState.CONNECTING
    history: list[PrefillState] = field(default_factory=lambda: [PrefillState.CONNECTING])
    """Every state it has been in, in order (for logs and tests)."""
    abandoned: bool = False
    """The client left while its KV was on the wire: the transfer still finishes (or fails)
    and the drain waits for it, but nobody reads the answer."""
    reason: str = ""
    """Why it ended, for FAILED and ABORTED."""
    shipment: Shipment | None = None
    """Set when it enters SENDING."""
    key: int = field(default_factory=lambda: next(_serial))
    timing: PrefillTimes = field(default_factory=lambda: PrefillTimes())
    """Where its time went on this worker (PrefillResponse.timing)."""

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL


def move(record: PrefillRecord, new: PrefillState, reason: str = "") -> None:
    """The one way a record changes state; an illegal move is a bug (AssertionError)."""
    assert new in TRANSITIONS[record.state], (
        f"prefill request {record.request_id}: illegal move {record.state.name} -> {new.name} "
        f"(history {[s.name for s in record.history]})")
    record.state = new
    record.history.append(new)
    if reason:
        record.reason = reason


def settle(future: Future, result: object = None, error: BaseException | None = None) -> bool:
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
    queue_s: float = 0.0
    compute_s: float = 0.0
    first_token_at: float = 0.0
    """Unix time the first token was sampled (0: unknown)."""
    wire_seconds: float | None = None
    """The part of `seconds` the channel had bytes to move (TransferResult.wire_seconds)."""


@dataclass(frozen=True)
class DecodeTarget:
    """Where a prefill's KV must go (from the decode worker's ticket)."""

    decode_address: str
    incarnation: str
    ticket_id: int
    num_cached_tokens: int
    num_blocks: int


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill computes exactly the first token: same sampling, one token, no stops."""
    return replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=(),
                   stop_token_ids=params.stop_token_ids)
