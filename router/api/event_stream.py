"""An SSE response that notices a client leaving and always closes its source.

Starlette's StreamingResponse finds out about a disconnect only when a write fails (ASGI spec
2.4) or cancels the body task without closing the iterator (older servers), so a backend could
keep generating for nobody. This response writes the lines in one task and listens for
`http.disconnect` in another; whichever ends first, it cancels the writer and then closes the
lines and the source, shielded from cancellation, so the backend always hears the abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.serving.fanout import run_shielded


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """200 text/event-stream of `lines` (encoded: UTF-8 bytes); `on_close` runs after the last
    line or a disconnect."""

    media_type = "text/event-stream"

    def __init__(
        self,
        lines: AsyncGenerator[bytes, None],
        on_close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self._lines = lines
        self._on_close = on_close
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            await run_shielded(self._close())
        if writer.done() and not writer.cancelled():
            error = writer.exception()
            if error is not None and not isinstance(error, OSError):  # OSError: client gone
                raise error

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for line in self._lines:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        await self._lines.aclose()
        await self._on_close()
