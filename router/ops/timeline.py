"""Per-request P/D timelines: where each request's time went, kept in a bounded ring.

A `Timeline` is written once, when its client request ends (every path: done, stop string,
error, client gone), by the serving path's recorder; the ring (`TimelineStore`) keeps the last
`capacity` of them by the request id the client saw in `X-Request-Id`. A later request reusing
an id replaces the earlier one. Readers (the timeline routes, the dashboard's waterfall, the
dashboard history and the planner) only read frozen values; subscribers are called on the
event loop that records, so they must not block.

Times: `arrival_unix` is the router's wall clock at arrival; every phase and mark is in
milliseconds since arrival on the router's monotonic clock. The phases are contiguous and in
order: each starts where the previous ended, the first at 0 and the last at `e2e_ms`, so they
add up to the end-to-end time. Worker-side times (prefill compute, KV transfer) are durations
measured on the worker, reported as `detail` of the router-side phase that contains them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

DEFAULT_TIMELINE_CAPACITY = 1000


@dataclass(frozen=True)
class Phase:
    name: str
    """e.g. "validate", "admission_wait", "reserve", "prefill", "decode" (the recorder's list)."""
    start_ms: float
    end_ms: float
    detail: tuple[tuple[str, float | str], ...] = ()
    """Numbers and names measured inside the phase (worker-side seconds, tokens, worker ids)."""

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class Mark:
    name: str
    """A point in time: "first_token", "last_token"."""
    at_ms: float


@dataclass(frozen=True)
class RouteSummary:
    prefill_id: str | None
    """None: the decode worker prefilled the prompt itself."""
    decode_id: str
    reason: str
    """The policy's one-line reason."""
    inputs: tuple[tuple[str, float], ...] = ()
    fallback: str | None = None


@dataclass(frozen=True)
class TransferSummary:
    nbytes: int
    seconds: float
    """Doorbell to ack on the prefill worker: with layer streaming the transfer opens while the
    prefill computes, so this includes the wait for its layers and first token."""
    num_blocks: int
    """Blocks sent over the data channel."""
    blocks_skipped: int
    """Prompt blocks the decode worker already held (its prefix-cache hit): not sent."""
    backend: str
    wire_seconds: float | None = None
    """The part of `seconds` the channel had bytes to move (an upper bound: it keeps the
    sender's waits for its process's GIL); None: the worker did not say."""

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes per second) over `seconds` (the compute waits included); 0 when
        nothing was timed."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def wire_gbps(self) -> float | None:
        """GB/s over wire_seconds: the channel's speed; None when not measured."""
        if self.wire_seconds is None:
            return None
        return self.nbytes / self.wire_seconds / 1e9 if self.wire_seconds > 0 else 0.0


@dataclass(frozen=True)
class Timeline:
    request_id: str
    """The id returned in X-Request-Id."""
    arrival_unix: float
    e2e_ms: float
    phases: tuple[Phase, ...]
    """Contiguous, in order, from 0 to e2e_ms (of the first sequence when n > 1)."""
    marks: tuple[Mark, ...] = ()
    finish_reason: str | None = None
    """"stop", "length", "abort", or "error"; None only while unfinished (never stored)."""
    path: str | None = None
    """"disaggregated" or "colocated"."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    route: RouteSummary | None = None
    transfer: TransferSummary | None = None
    error: str | None = None
    """The message of the error the request ended with, if any."""
    sequences: int = 1
    """Backend requests of this client request (prompts x n); the phases are the first's."""
    model: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return next((m.at_ms for m in self.marks if m.name == "first_token"), None)

    def to_json(self) -> dict[str, object]:
        body = asdict(self)
        body["phases"] = [{**asdict(p), "detail": dict(p.detail), "duration_ms": p.duration_ms}
                          for p in self.phases]
        body["ttft_ms"] = self.ttft_ms
        if self.route is not None:
            body["route"] = {**asdict(self.route), "inputs": dict(self.route.inputs)}
        if self.transfer is not None:
            body["transfer"] = {**asdict(self.transfer), "gbps": self.transfer.gbps,
                                "wire_gbps": self.transfer.wire_gbps}
        return body


@dataclass(frozen=True)
class _Unbuilt:
    """A timeline recorded and not yet read: built on first read."""

    e2e_ms: float
    build: Callable[[], Timeline]


@dataclass
class TimelineStore:
    """The last `capacity` timelines by request id (memory bounded by capacity)."""

    capacity: int = DEFAULT_TIMELINE_CAPACITY
    _ring: OrderedDict[str, Timeline | _Unbuilt] = field(default_factory=OrderedDict)
    _subscribers: list[Callable[[Timeline], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"timeline capacity must be >= 1, got {self.capacity}")

    def put(self, timeline: Timeline) -> None:
        """Stores it (evicting the oldest beyond capacity), then tells each subscriber."""
        self._keep(timeline.request_id, timeline)
        for callback in self._subscribers:
            callback(timeline)

    def put_later(self, request_id: str, e2e_ms: float, build: Callable[[], Timeline]) -> None:
        """Stores the timeline `build()` makes (its e2e_ms given here), built when first read:
        a router records one per request and most are never read (~4% of its CPU a request
        when built at once). With subscribers it is built now and put()."""
        if self._subscribers:
            self.put(build())
            return
        self._keep(request_id, _Unbuilt(e2e_ms, build))

    def _keep(self, request_id: str, entry: Timeline | _Unbuilt) -> None:
        self._ring.pop(request_id, None)
        self._ring[request_id] = entry
        while len(self._ring) > self.capacity:
            self._ring.popitem(last=False)

    def _built(self, request_id: str, entry: Timeline | _Unbuilt) -> Timeline:
        if isinstance(entry, _Unbuilt):
            entry = self._ring[request_id] = entry.build()  # an existing key keeps its place
        return entry

    def subscribe(self, callback: Callable[[Timeline], None]) -> None:
        """callback(timeline) after each put; runs on the recording loop, must not block."""
        self._subscribers.append(callback)

    def get(self, request_id: str) -> Timeline | None:
        entry = self._ring.get(request_id)
        return None if entry is None else self._built(request_id, entry)

    def recent(self, limit: int) -> list[Timeline]:
        """Newest first."""
        newest = list(reversed(self._ring.items()))[:limit]
        return [self._built(rid, entry) for rid, entry in newest]

    def slowest(self, limit: int) -> list[Timeline]:
        """Longest end-to-end first."""
        longest = sorted(self._ring.items(), key=lambda item: item[1].e2e_ms, reverse=True)[:limit]
        return [self._built(rid, entry) for rid, entry in longest]

    def __len__(self) -> int:
        return len(self._ring)
