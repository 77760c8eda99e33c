"""LinkServer: a worker's end of the worker link (see the package docstring).

Per connection: OPENING (handshake.py; closed without a word when the proof fails or is late)
-> OPEN (calls run) -> CLOSED. Per call: a task runs the servicer method with a LinkContext;
its responses go out as MESSAGE frames, then one END with its status. What ends a call early:

  CANCEL from the caller   the task is cancelled (the servicer's `finally` runs, as under gRPC
                           when a caller leaves); no END is sent
  the connection closes    every call on it is cancelled the same way
  stop(grace)              new connections are refused; calls get `grace` seconds to end,
                           then are cancelled

A response is written when the connection can take it (the transport's flow control): a slow
caller holds back its worker's writes instead of growing a buffer without bound, and a caller
that takes nothing for WRITE_STALL_S is taken for gone (its connection closes, its calls are
cancelled as above).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import time
from collections.abc import Callable, Iterable

import grpc
from google.protobuf.message import DecodeError, Message

from proto.limits import INTERNAL_MAX_MESSAGE_BYTES
from proto.link import handshake
from proto.link.coalesce import CoalescingWriter
from proto.link.frames import (
    OK, FrameKind, FrameReader, LinkProtocolError, LinkStatus, encode_status, frame)
from proto.link.methods import LinkMethod

__all__ = ["LinkAbort", "LinkContext", "LinkServer"]

logger = logging.getLogger(__name__)

WRITE_STALL_S = 60.0
"""Longest a response waits for a caller that reads nothing before its connection is closed."""


class LinkAbort(Exception):
    """Raised by LinkContext.abort: ends the call with `status`."""

    def __init__(self, status: LinkStatus) -> None:
        super().__init__(f"{status.code.name}: {status.details}")
        self.status = status


class LinkContext:
    """What a servicer method gets for `context` on the link: abort() only, the one part of
    grpc.aio.ServicerContext the workers' servicers use."""

    __slots__ = ()

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Iterable[tuple[str, str]] = ()) -> None:
        """Ends the call with `code` (never returns, as in gRPC)."""
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs an error code, not OK")
        raise LinkAbort(LinkStatus(code, details, tuple(trailing_metadata)))


class ConnectionState(enum.Enum):
    OPENING = "opening"
    OPEN = "open"
    CLOSED = "closed"


class LinkServer:
    """Serves `methods` of `servicer` on host:port to callers that prove `secret`."""

    def __init__(self, secret: bytes, servicer: object, methods: Iterable[LinkMethod], host: str, port: int,
                 *, max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES,
                 handshake_timeout_s: float = handshake.HANDSHAKE_TIMEOUT_S, write_stall_s: float = WRITE_STALL_S) -> None:
        if not secret:
            raise ValueError("the cluster secret is empty")
        self._secret = secret
        self._handlers: dict[int, tuple[LinkMethod, Callable]] = {
            m.id: (m, getattr(servicer, m.name)) for m in methods}
        self._host, self._port = host, port
        self.max_message_bytes = max_message_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.write_stall_s = write_stall_s
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self.port: int | None = None
        """The bound port, once started."""
        self.refused = 0
        """Connections closed for a failed or late opening (a count for tests and logs)."""
        self._last_refusal_log = 0.0

    async def start(self) -> int:
        """Bind and serve; the port (a free one when asked for 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), self._host, self._port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Refuse new connections; let calls in flight end within `grace_s`, then cancel them
        and close every connection."""
        if self._server is not None:
            self._server.close()
        tasks = [t for c in self._connections for t in c.calls.values()]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        for connection in list(self._connections):
            connection.close()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def calls_in_flight(self) -> int:
        return sum(len(c.calls) for c in self._connections)

    def handler(self, method_id: int) -> tuple[LinkMethod, Callable] | None:
        return self._handlers.get(method_id)

    def refuse(self, peer: object, reason: str) -> None:
        """Count a refused opening; logged at most every 10 s, so a flood cannot flood the log."""
        self.refused += 1
        now = time.monotonic()
        if now - self._last_refusal_log >= 10.0:
            self._last_refusal_log = now
            logger.warning("refused a link connection from %s: %s (%d refused so far)", peer, reason, self.refused)


class _ServerConnection(asyncio.Protocol):
    """One caller's connection (see the module docstring for its states)."""

    def __init__(self, server: LinkServer) -> None:
        self.server = server
        self.state = ConnectionState.OPENING
        self.calls: dict[int, asyncio.Task] = {}
        self._transport: asyncio.Transport | None = None
        self._writer: CoalescingWriter | None = None
        self._opening = bytearray()
        self._server_nonce = b""
        self._reader = FrameReader(server.max_message_bytes + 16)
        self._writable = asyncio.Event()
        self._writable.set()
        self._deadline: asyncio.TimerHandle | None = None
        self._peer: object = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport) -> None:
        self._transport = transport
        self._writer = CoalescingWriter(transport, asyncio.get_running_loop())
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.server._connections.add(self)
        hello, self._server_nonce = handshake.hello()
        transport.write(hello)
        self._deadline = asyncio.get_running_loop().call_later(
            self.server.handshake_timeout_s, self._opening_timed_out)

    def data_received(self, data: bytes) -> None:
        if self.state is ConnectionState.OPENING:
            data = self._open(data)
            if not data:
                return
        try:
            frames = self._reader.feed(data)
        except LinkProtocolError as exc:
            self._broken(str(exc))
            return
        for call_id, kind, payload in frames:
            if kind == FrameKind.CALL:
                self._start_call(call_id, payload)
            elif kind == FrameKind.CANCEL:
                task = self.calls.pop(call_id, None)
                if task is not None:
                    task.cancel()
            else:
                self._broken(f"a caller sent a {FrameKind(kind).name} frame")
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = ConnectionState.CLOSED
        self.server._connections.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()
        for task in self.calls.values():
            task.cancel()
        self.calls.clear()
        self._writable.set()  # a writer waiting for room finds the connection closed instead

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ------------------------------------------------------------------ opening
    def _open(self, data: bytes) -> bytes:
        """Consume the caller's PROOF; the bytes after it (frames), or b"" while incomplete or refused."""
        self._opening += data
        if len(self._opening) < handshake.PROOF_BYTES:
            return b""
        proof, rest = bytes(self._opening[:handshake.PROOF_BYTES]), bytes(self._opening[handshake.PROOF_BYTES:])
        self._opening.clear()
        client_nonce = handshake.check_proof(self.server._secret, self._server_nonce, proof)
        if client_nonce is None:
            self.server.refuse(self._peer, "the cluster secret's proof does not verify (wrong secret?)")
            self.close()
            return b""
        self._deadline.cancel()
        self.state = ConnectionState.OPEN
        self._transport.write(handshake.accept_for(self.server._secret, self._server_nonce, client_nonce))
        return rest

    def _opening_timed_out(self) -> None:
        if self.state is ConnectionState.OPENING:
            self.server.refuse(self._peer, f"no proof within {self.server.handshake_timeout_s:g} s")
            self.close()

    def _broken(self, reason: str) -> None:
        """Close at once, dropping what is buffered (a broken or stalled peer never takes it)."""
        logger.warning("closing the link connection from %s: %s", self._peer, reason)
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # ------------------------------------------------------------------ calls
    def _start_call(self, call_id: int, payload: bytes) -> None:
        if call_id in self.calls:
            self._broken(f"call id {call_id} is already in use")
            return
        entry = self.server.handler(payload[0]) if payload else None
        if entry is None:
            name = f"method {payload[0]}" if payload else "a CALL without a method"
            self._end(call_id, LinkStatus(grpc.StatusCode.UNIMPLEMENTED, f"this worker's link does not serve {name}"))
            return
        method, handler = entry
        try:
            request = method.request.FromString(payload[1:])
        except DecodeError as exc:
            self._end(call_id, LinkStatus(grpc.StatusCode.INTERNAL, f"the {method.name} request does not parse: {exc}"))
            return
        task = asyncio.get_running_loop().create_task(self._run(call_id, method, handler, request))
        self.calls[call_id] = task

    async def _run(self, call_id: int, method: LinkMethod, handler: Callable, request: Message) -> None:
        try:
            if method.streaming:
                async with contextlib.aclosing(handler(request, LinkContext())) as responses:
                    async for response in responses:
                        await self._send(call_id, self._encode(method, response))
                status = OK
            else:
                response = await handler(request, LinkContext())
                data = self._encode(method, response)
                if self.calls.get(call_id) is asyncio.current_task():
                    self._write(frame(call_id, FrameKind.MESSAGE, data)
                                + frame(call_id, FrameKind.END, encode_status(OK)))
                self.calls.pop(call_id, None)
                return
        except LinkAbort as exc:
            status = exc.status
        except asyncio.CancelledError:  # the caller left, the connection closed, or the server stops
            self.calls.pop(call_id, None)
            return
        except Exception as exc:  # a bug in the servicer: the caller gets UNKNOWN, the log the trace
            logger.exception("link call %s failed", method.name)
            status = LinkStatus(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
        if self.calls.get(call_id) is asyncio.current_task():
            self._end(call_id, status)
        self.calls.pop(call_id, None)

    def _encode(self, method: LinkMethod, response: Message) -> bytes:
        if not isinstance(response, method.response):
            raise TypeError(f"{method.name} returned {type(response).__name__}, not {method.response.__name__}")
        data = response.SerializeToString()
        if len(data) > self.server.max_message_bytes:
            raise LinkAbort(LinkStatus(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"Sent message larger than max ({len(data)} vs. {self.server.max_message_bytes})"))
        return data

    async def _send(self, call_id: int, data: bytes) -> None:
        """One MESSAGE, once the connection can take it; CancelledError once it is closed (or
        closed now: the caller took nothing for write_stall_s)."""
        if not self._writable.is_set():
            try:
                async with asyncio.timeout(self.server.write_stall_s):
                    await self._writable.wait()
            except TimeoutError:
                self._broken(f"the caller took nothing for {self.server.write_stall_s:g} s")
                raise asyncio.CancelledError() from None
        if self.state is ConnectionState.CLOSED:
            raise asyncio.CancelledError()
        self._write(frame(call_id, FrameKind.MESSAGE, data))

    def _end(self, call_id: int, status: LinkStatus) -> None:
        self._write(frame(call_id, FrameKind.END, encode_status(status)))

    def _write(self, data: bytes) -> None:
        if self.state is ConnectionState.OPEN:
            self._writer.write(data)
