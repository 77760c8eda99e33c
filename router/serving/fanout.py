"""Running the backend requests of one client request and merging their deltas.

Streams are polled lazily: the next delta of a stream is asked for only after the caller has
consumed the previous one, so a caller that sees a stop string can `stop()` that stream before
the backend is asked for more. `aclose()` must always be called; it closes every stream and
aborts every backend request that has not finished, so no worker keeps generating for a client
that is gone.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from router.serving.backend import BackendRequest, GenerationBackend, TokenDelta
from router.errors import WorkerFailure

logger = logging.getLogger(__name__)

# Cleanups running past a cancelled caller; held here so they are not garbage-collected.
_CLEANUPS: set[asyncio.Task[None]] = set()


# Set inside a shielded cleanup's task: a cleanup it starts (a response's close closing its
# run) is shielded already and runs inline, without a task of its own.
_SHIELDED: contextvars.ContextVar[bool] = contextvars.ContextVar("pdserve_shielded", default=False)


async def run_shielded(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to completion even if the caller is cancelled (client disconnects cancel the
    handler, but the backend must still hear the abort).

    It starts at once, in the caller's task, and only what is left when it first waits goes on
    in a task of its own (what asyncio's eager tasks do from Python 3.12 on): most cleanups
    never wait (a request that finished has nothing left to abort), and then cost no task and
    no pass of the event loop, so a stream's last tokens and its end leave in one write. Until
    that first wait a cancel cannot reach it: cancels are delivered at waits only."""
    if _SHIELDED.get():
        await coro
        return
    shielded = _SHIELDED.set(True)
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return
    finally:
        _SHIELDED.reset(shielded)
    task = asyncio.ensure_future(_go_on(coro, waiting_on))
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)
    await asyncio.shield(task)


async def _go_on(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Drives `coro` on from where it first waited (on `waiting_on`: a future, or None for a
    bare pass of the loop), as its task would."""
    _SHIELDED.set(True)  # the task runs in a copy of the caller's context: the caller is untouched
    while True:
        if waiting_on is None:
            await asyncio.sleep(0)
        else:
            # Taken over as a task takes over the future its coroutine yields: the flag says
            # the coroutine waits for it, and awaiting it again must not find it set.
            waiting_on._asyncio_future_blocking = False
            try:
                await waiting_on
            except BaseException:  # noqa: BLE001 - `coro` reads the outcome itself when it resumes
                pass
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return


class FanOut:
    """Merges the delta streams of several backend requests. Not thread-safe; one per client
    request. Owns the streams it opens."""

    def __init__(self, backend: GenerationBackend, requests: Sequence[BackendRequest]) -> None:
        self._backend = backend
        self._requests = tuple(requests)
        self._streams: list[AsyncIterator[TokenDelta]] = [backend.generate(r) for r in requests]
        self._active = set(range(len(self._requests)))  # neither finished nor stopped
        self._pending: dict[asyncio.Task[TokenDelta], int] = {}
        self._ready: deque[tuple[int, TokenDelta]] = deque()
        self._closed = False

    async def next(self) -> tuple[int, TokenDelta] | None:
        """(stream index, delta) of the next delta to arrive, or None once every stream has
        finished. Raises what a backend raises, and WorkerFailure for a stream that ends
        without a finish reason."""
        if not self._ready and not self._pending and len(self._active) == 1:
            return await self._next_of_only(next(iter(self._active)))
        while not self._ready:
            polled = set(self._pending.values())
            for i in sorted(self._active - polled):
                self._pending[asyncio.ensure_future(anext(self._streams[i]))] = i
            if not self._pending:
                return None
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: self._pending[t]):
                i = self._pending.pop(task)
                self._ready.append((i, self._take(i, task)))
        return self._ready.popleft()

    async def _next_of_only(self, i: int) -> tuple[int, TokenDelta]:
        """The one stream still active, with nothing in flight, awaited directly: the common
        n=1 case pays no task and no asyncio.wait per delta. Cancelling the caller cancels the
        stream as cancelling its task would (aclose() then aborts the request)."""
        try:
            delta = await anext(self._streams[i])
        except StopAsyncIteration:
            raise WorkerFailure(
                f"backend stream of {self._requests[i].request_id} ended without a finish reason"
            ) from None
        if delta.finish_reason is not None:
            self._active.discard(i)
        return i, delta

    def _take(self, i: int, task: asyncio.Task[TokenDelta]) -> TokenDelta:
        try:
            delta = task.result()
        except StopAsyncIteration:
            raise WorkerFailure(
                f"backend stream of {self._requests[i].request_id} ended without a finish reason"
            ) from None
        if delta.finish_reason is not None:
            self._active.discard(i)
        return delta

    async def stop(self, i: int) -> None:
        """Stop stream `i` early (a stop string matched): close it and abort its request."""
        assert i not in self._pending.values(), f"stream {i} stopped while a delta is in flight"
        if i not in self._active:
            return
        self._active.discard(i)
        await _close(self._streams[i])
        await self._backend.abort(self._requests[i].request_id)

    async def aclose(self) -> None:
        """Close every stream and abort the unfinished requests. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pending:
            for task in self._pending:
                task.cancel()
            await asyncio.gather(*self._pending, return_exceptions=True)
            self._pending.clear()
        for stream in self._streams:
            await _close(stream)
        unfinished = [self._requests[i].request_id for i in sorted(self._active)]
        self._active.clear()
        for request_id in unfinished:
            await self._backend.abort(request_id)


async def _close(stream: AsyncIterator[TokenDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # a broken stream must not keep the others from being aborted
        logger.exception("closing a backend stream failed")
