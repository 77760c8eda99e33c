"""An SSE response that notices a client leaving and always closes its source.

Starlette's StreamingResponse finds out about a disconnect only when a write fails (ASGI spec
2.4) or cancels the body task without closing the iterator (older servers), so a backend could
keep generating for nobody. This response writes the lines in the handler's own task while a
watcher task listens for `http.disconnect` and cancels the writing when it comes
(`DisconnectWatch`, the same one that watched the handler's wait for the first token); either
way it then closes the lines and the source, shielded from cancellation, so the backend always
hears the abort.

The work stays in the handler's task rather than a task of its own: a token that arrives goes
on to the client in the same loop pass, where a task of its own reached its waiter a pass or
two later, each a pass over every other stream's tokens under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.serving.fanout import run_shielded

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """One request's watch for its client leaving, across the handler's wait for the first
    token and the response's writing (one watcher task and one pending receive a request, not
    one per phase). `until(work)` awaits `work` in the calling task; if the client leaves
    meanwhile, the watcher cancels the task there (`work` sees CancelledError, as a task of its
    own would) and ClientDisconnected is raised; a client that left between two `until`s gets
    ClientDisconnected at the next one. A cancel from elsewhere (the server stopping)
    propagates unchanged. `close()` ends the watcher; the request's last user calls it."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watcher: asyncio.Future[None] | None = None
        self._caller: asyncio.Task | None = None
        self.left = False

    async def until(self, work: Awaitable[T]) -> T:
        caller = asyncio.current_task()
        assert caller is not None, "DisconnectWatch.until runs in a task"
        if self.left:
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientDisconnected()
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        self._caller = caller
        try:
            result = await work
        except asyncio.CancelledError:
            if not self.left:
                raise
            caller.uncancel()
            raise ClientDisconnected() from None
        finally:
            self._caller = None
        if self.left:  # `work` swallowed the watcher's cancel and ended: its result still counts
            caller.uncancel()
        return result

    async def _watch(self) -> None:
        await wait_for_disconnect(self._receive)
        self.left = True
        if self._caller is not None:
            self._caller.cancel()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """`work` under a watch of its own (DisconnectWatch.until), closed when it ends."""
    watch = DisconnectWatch(receive)
    try:
        return await watch.until(work)
    finally:
        watch.close()


class EventStreamResponse(Response):
    """200 text/event-stream of `lines` (encoded: UTF-8 bytes); `on_close` runs after the last
    line or a disconnect."""

    media_type = "text/event-stream"

    def __init__(
        self,
        lines: AsyncGenerator[bytes, None],
        on_close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
        watch: DisconnectWatch | None = None,
    ) -> None:
        """watch: the request's watch, which the response takes over and closes (None: one of
        its own on the receive it is called with)."""
        self.status_code = 200
        self.background = None
        self._lines = lines
        self._on_close = on_close
        self._watch = watch
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self._watch or DisconnectWatch(receive)
        try:
            await watch.until(self._write(send))
        except (ClientDisconnected, OSError):  # OSError: a write found the client gone
            pass
        finally:
            watch.close()
            await run_shielded(self._close())

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for line in self._lines:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        await self._lines.aclose()
        await self._on_close()
