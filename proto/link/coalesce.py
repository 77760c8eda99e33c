"""Frames written during one pass of the event loop leave in one send.

A decode step streams a token to every running request, and a busy router starts calls for
several requests in the same pass; a send per frame was a system call each (the largest
single cost left in a router's request path after gRPC went). The frames wait for the end of
the current pass (call_soon), not for a timer, so a lone frame is not held back; past
FLUSH_BYTES they go at once, so a writer that never yields meets the transport's flow control
(pause_writing) instead of a buffer without bound.
"""

from __future__ import annotations

import asyncio

__all__ = ["FLUSH_BYTES", "CoalescingWriter"]

FLUSH_BYTES = 256 * 1024


class CoalescingWriter:
    """Buffers writes to `transport` and sends them together at the end of the loop's pass."""

    __slots__ = ("_transport", "_loop", "_parts", "_pending")

    def __init__(self, transport: asyncio.WriteTransport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._parts: list[bytes] = []
        self._pending = 0

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(data)
        self._pending += len(data)
        if self._pending >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        parts, self._parts, self._pending = self._parts, [], 0
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))
