"""Admission control: requests wait in the router, FIFO, for a decode worker with room.

One request's lifecycle here:

    arrives, nobody waiting -> tries at once (the decode workers reserve or refuse)
        admitted                         -> leaves (queue time 0)
        refused by every decode worker   -> WAITING at the tail
    arrives, others waiting -> WAITING at the tail (no overtaking: a long prompt at the
                               head is never starved by short ones behind it)
    queue already holds max_queued       -> REJECTED at once: 503 + Retry-After
    WAITING at the head -> tries again whenever blocks are freed (a request finished here)
                           and at least every poll_interval_s (other routers free blocks too)
        admitted                         -> leaves; the next head tries at once
        waited max_wait_s                -> REJECTED: 503 + Retry-After
    (terminal: admitted, rejected; an error from an attempt propagates and also leaves)

Retry-After is estimated from how fast blocks were freed lately: the blocks the queue ahead
needs plus this request's, divided by the freeing rate, clamped to [1, 60] s.

Runs on the router's event loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from router.errors import Overloaded

__all__ = ["AdmissionQueue", "AdmissionSettings", "FreeRate", "REJECT_REASONS"]

T = TypeVar("T")

REJECT_REASONS = ("queue_full", "queue_timeout")
"""Labels of pdserve_admission_rejections_total the queue itself produces."""


@dataclass(frozen=True)
class AdmissionSettings:
    """Bounds of the router's admission queue."""

    max_queued: int = 256
    """Requests that may wait at once; one more is refused with 503 at once. 0: never wait."""
    max_wait_s: float = 30.0
    """Longest a request waits for room before it is refused with 503."""
    poll_interval_s: float = 0.2
    """The head of the queue retries at least this often, even if nothing was freed here."""
    rate_window_s: float = 30.0
    """Block frees within this window estimate Retry-After."""

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0; got {self.max_queued}")
        for name in ("max_wait_s", "poll_interval_s", "rate_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")


class FreeRate:
    """Blocks freed per second over a sliding window, from (time, blocks) records."""

    MIN_RETRY_S = 1.0
    MAX_RETRY_S = 60.0

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._started = clock()

    def record(self, blocks: int) -> None:
        self._events.append((self._clock(), blocks))
        self._trim()

    def per_second(self) -> float:
        """Blocks freed per second in the window (0.0 when none were)."""
        self._trim()
        span = min(self.window_s, max(self._clock() - self._started, 1e-9))
        return sum(blocks for _, blocks in self._events) / span

    def retry_after_s(self, blocks: int) -> float:
        """Seconds until `blocks` are likely free at the recent rate, in [1, 60]; 60 when
        nothing was freed lately (the cluster is stuck or idle-full)."""
        rate = self.per_second()
        if rate <= 0:
            return self.MAX_RETRY_S
        return min(max(blocks / rate, self.MIN_RETRY_S), self.MAX_RETRY_S)

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()


@dataclass
class _Waiter:
    blocks: int
    enqueued_at: float
    wake: asyncio.Event


class AdmissionQueue:
    """The FIFO of requests waiting for decode room, with its bounds and counters."""

    def __init__(self, settings: AdmissionSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._queue: deque[_Waiter] = deque()
        self.free_rate = FreeRate(settings.rate_window_s, clock)
        self.rejections: Counter[str] = Counter()
        """Refusals by reason (REJECT_REASONS)."""
        self.admitted_after_wait = 0

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def blocks_waiting(self) -> int:
        """Blocks the waiting requests need (their prompts)."""
        return sum(w.blocks for w in self._queue)

    def blocks_freed(self, blocks: int) -> None:
        """A request that held `blocks` decode blocks ended: record it and wake the head."""
        self.free_rate.record(blocks)
        if self._queue:
            self._queue[0].wake.set()

    async def admit(self, attempt: Callable[[], Awaitable[T | None]], blocks: int) -> tuple[T, float]:
        """Run `attempt` (None: no room now) until it returns a value, in FIFO order.

        Returns (the value, seconds spent waiting). Raises Overloaded when the queue is full
        or the wait runs out, and whatever `attempt` raises. Cancellation leaves the queue.
        """
        tried = not self._queue
        if tried:
            result = await attempt()
            if result is not None:
                return result, 0.0
        if len(self._queue) >= self.settings.max_queued:
            raise self._reject("queue_full", self.blocks_waiting(), blocks,
                               f"the router's admission queue is full ({self.num_waiting} waiting)")
        waiter = _Waiter(blocks, self._clock(), asyncio.Event())
        self._queue.append(waiter)
        try:
            return await self._wait_turns(waiter, attempt, wait_first=tried)
        finally:
            self._leave(waiter)

    async def _wait_turns(self, waiter: _Waiter, attempt: Callable[[], Awaitable[T | None]],
                          wait_first: bool) -> tuple[T, float]:
        """wait_first: the request has just failed an attempt, so it waits for a free or a
        poll interval before its next one."""
        deadline = waiter.enqueued_at + self.settings.max_wait_s
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise self._reject("queue_timeout", self._blocks_ahead(waiter), waiter.blocks, (
                    f"no decode worker had room for {waiter.blocks} KV blocks within "
                    f"{self.settings.max_wait_s:g} s"))
            at_head = self._queue[0] is waiter
            waiter.wake.clear()  # before the attempt: a free during it must not be lost
            if at_head and not wait_first:
                result = await attempt()
                if result is not None:
                    self.admitted_after_wait += 1
                    return result, self._clock() - waiter.enqueued_at
            wait_first = False
            timeout = min(self.settings.poll_interval_s, remaining) if at_head else remaining
            try:
                await asyncio.wait_for(waiter.wake.wait(), max(timeout, 0.0))
            except asyncio.TimeoutError:
                pass

    def _leave(self, waiter: _Waiter) -> None:
        was_head = bool(self._queue) and self._queue[0] is waiter
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        if was_head and self._queue:
            self._queue[0].wake.set()  # the next in line tries at once

    def _blocks_ahead(self, waiter: _Waiter) -> int:
        ahead = 0
        for other in self._queue:
            if other is waiter:
                break
            ahead += other.blocks
        return ahead

    def _reject(self, reason: str, ahead: int, blocks: int, why: str) -> Overloaded:
        self.rejections[reason] += 1
        retry_s = self.free_rate.retry_after_s(ahead + blocks)
        return Overloaded(
            f"{why}; this request needs {blocks} KV blocks behind {ahead} blocks queued ahead "
            f"of it; retry in about {math.ceil(retry_s)} s",
            retry_after_s=retry_s,
        )
