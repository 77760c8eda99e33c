"""Records one client request's timeline (router/ops/timeline.py) and stores it when it ends.

The phases, in order, each from where the previous ended (so they add up to e2e exactly):

  validate        arrival -> the backend starts (model check, limits, template, tokenize)
  admission_wait  -> the Decode call that got the reservation (snapshot, policy, the
                     router's admission queue, refused attempts on full decode workers)
  reserve         -> the ticket (the decode worker reserved blocks for the prompt)
  prefill         -> the first token in the router's hands (the Prefill RPC, or the decode
                     stream's early first token; the prefill worker's queue/compute and the
                     KV transfer as detail; on the colocated path the decode worker's prefill)
  decode          -> the last token
  finish          -> the end of the response (the run closed)

A backend that does not trace (a test script, a local engine) gets one phase, "backend", from
its start to the first token. A boundary the request never reached (an error before its ticket, a backend that does not
trace) is left out, and the phase before it runs on. Boundaries come from two clocks that are
both time.monotonic in the router (the run's and the backend's); each is clamped between its
neighbours, so a test clock cannot make a phase negative.
"""

from __future__ import annotations

from collections.abc import Callable

from router.ops.timeline import Mark, Phase, Timeline, TimelineStore
from router.serving.backend import TokenDelta
from router.serving.trace import BackendTrace

PHASES = ("validate", "admission_wait", "reserve", "prefill", "decode", "finish")


class TimelineRecorder:
    """One per client request; writes one Timeline into the store when the request ends."""

    def __init__(self, store: TimelineStore, request_id: str, model: str,
                 clock: Callable[[], float], wall_clock: Callable[[], float]) -> None:
        self._store = store
        self._request_id = request_id
        self._model = model
        self._clock = clock
        self._arrived = clock()
        self._arrival_unix = wall_clock()
        self._dispatched: float | None = None
        self._trace: BackendTrace | None = None
        self._first: float | None = None
        self._last: float | None = None
        self._error: str | None = None

    def dispatched(self) -> None:
        """The run asks the backend for its first delta (the backend's start, untraced)."""
        if self._dispatched is None:
            self._dispatched = self._clock()

    def on_delta(self, index: int, delta: TokenDelta) -> None:
        """Every delta of every sequence; only the first sequence's are timed."""
        if index != 0:
            return
        if self._trace is None and delta.trace is not None:
            self._trace = delta.trace
        if delta.token_ids:
            now = self._clock()
            self._first = self._first if self._first is not None else now
            self._last = now

    def failed(self, error: Exception) -> None:
        self._error = str(error)

    def finish(self, *, finish_reason: str | None, path: str | None, prompt_tokens: int,
               completion_tokens: int, sequences: int) -> None:
        """Ends the timeline now and stores it (built when first read: TimelineStore.put_later)."""
        e2e = self._ms(self._clock())
        error = self._error
        self._store.put_later(self._request_id, e2e, lambda: Timeline(
            request_id=self._request_id, arrival_unix=self._arrival_unix, e2e_ms=e2e,
            phases=self._phases(e2e), marks=self._marks(e2e),
            finish_reason="error" if error is not None else (finish_reason or "abort"),
            path=path, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            route=self._trace.route if self._trace else None,
            transfer=self._trace.transfer if self._trace else None,
            error=error, sequences=sequences, model=self._model))

    def _ms(self, t: float | None) -> float | None:
        return None if t is None else (t - self._arrived) * 1000.0

    def _starts(self) -> list[tuple[str, float | None]]:
        if self._trace is None:  # a backend that does not trace: one phase until the first token
            return [("validate", 0.0), ("backend", self._ms(self._dispatched)),
                    ("decode", self._ms(self._first)), ("finish", self._ms(self._last))]
        marks = self._trace.marks
        backend_start = marks.get("backend_start", self._dispatched)
        return [("validate", 0.0), ("admission_wait", self._ms(backend_start)),
                ("reserve", self._ms(marks.get("reserve_start"))), ("prefill", self._ms(marks.get("ticket"))),
                ("decode", self._ms(self._first)), ("finish", self._ms(self._last))]

    def _phases(self, e2e: float) -> tuple[Phase, ...]:
        bounds: list[tuple[str, float]] = []
        at = 0.0
        for name, start in self._starts():
            if start is None:
                continue
            at = min(max(start, at), e2e)
            bounds.append((name, at))
        ends = [start for _, start in bounds[1:]] + [e2e]
        return tuple(Phase(name, start, end, self._detail(name))
                     for (name, start), end in zip(bounds, ends, strict=True))

    def _detail(self, name: str) -> tuple[tuple[str, float | str], ...]:
        trace = self._trace
        if trace is None:
            return ()
        if name == "admission_wait":
            return (("queue_ms", trace.queue_s * 1000.0),)
        if name == "reserve":
            return tuple(trace.reserve.items())
        if name == "prefill":
            where = () if trace.route is None or trace.route.prefill_id else (("on", "decode worker"),)
            return tuple(trace.prefill.items()) + where
        return ()

    def _marks(self, e2e: float) -> tuple[Mark, ...]:
        marks = [("first_token", self._ms(self._first)), ("last_token", self._ms(self._last))]
        return tuple(Mark(name, min(at, e2e)) for name, at in marks if at is not None)
