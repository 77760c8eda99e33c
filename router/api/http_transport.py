"""The router's HTTP connections send what one pass of the event loop wrote in one system call.

uvicorn writes each ASGI message as it comes: a streamed completion's status line and headers,
every SSE event and the closing chunk each cost a send() (at one request in flight those were
the largest single item of the router's CPU per request: benchmarks/router_overhead.py). This
protocol is uvicorn's httptools protocol over a transport whose writes wait for the end of the
current loop pass (never for a timer), so the headers leave with the first event, and events
that were ready together leave together. Reading, flow control and closing are the real
transport's; close() and set_protocol() send what is buffered first.
"""

from __future__ import annotations

import asyncio

from proto.link.coalesce import CoalescingWriter

__all__ = ["CoalescingTransport", "http_protocol"]


class CoalescingTransport:
    """`transport` with writes coalesced per loop pass; everything else is passed through."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._writer = CoalescingWriter(transport, asyncio.get_running_loop())

    def write(self, data: bytes) -> None:
        if data:
            self._writer.write(bytes(data))

    def writelines(self, parts) -> None:
        self.write(b"".join(parts))

    def close(self) -> None:
        self._writer.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._writer.flush()
        self._transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._writer.flush()
        self._transport.set_protocol(protocol)

    def __getattr__(self, name: str):  # is_closing, get_extra_info, pause_reading, abort, ...
        return getattr(self._transport, name)


def http_protocol() -> type[asyncio.Protocol] | str:
    """The protocol class for uvicorn.Config(http=...): httptools with coalesced writes, or
    "auto" when uvicorn's httptools protocol is not importable (then uvicorn picks, unchanged)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]

    return CoalescingHttpToolsProtocol
