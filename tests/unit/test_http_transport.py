"""The router's HTTP connections (router/api/http_transport.py): what one loop pass writes
leaves in one send, in order; closing sends what is buffered first; the rest is the real
transport's."""

from __future__ import annotations

import asyncio

from router.api.http_transport import CoalescingTransport, http_protocol


class RecordingTransport:
    def __init__(self):
        self.writes, self.closed, self.protocol = [], False, None

    def write(self, data):
        self.writes.append(bytes(data))

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def set_protocol(self, protocol):
        self.protocol = protocol

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


def test_writes_of_one_loop_pass_leave_in_one_send_and_close_flushes_first():
    async def scenario():
        real = RecordingTransport()
        transport = CoalescingTransport(real)
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(memoryview(b"data: 1\n\n"))
        transport.writelines([b"data: ", b"2\n\n"])
        assert real.writes == []
        await asyncio.sleep(0)
        assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\ndata: 2\n\n"]
        transport.write(b"0\r\n\r\n")
        transport.close()
        assert real.writes[-1] == b"0\r\n\r\n" and real.closed
        assert transport.get_extra_info("peername") == ("127.0.0.1", 5) and transport.is_closing()

    asyncio.run(scenario())


def test_a_protocol_switch_sends_what_was_buffered_to_the_old_protocol_first():
    async def scenario():
        real = RecordingTransport()
        transport = CoalescingTransport(real)
        transport.write(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
        transport.set_protocol("ws")
        assert real.writes == [b"HTTP/1.1 101 Switching Protocols\r\n\r\n"] and real.protocol == "ws"

    asyncio.run(scenario())


def test_the_protocol_is_uvicorns_httptools_one_with_the_coalescing_transport():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(http_protocol(), HttpToolsProtocol)
