"""LinkChannel: a caller's end of the worker link (see the package docstring).

One connection per channel, opened by the first call (TCP connect and the opening, bounded by
connect_timeout_s) and again by the first call after it broke. Calls on it are shaped as
grpc.aio's, so the router's call sites and their error handling serve both transports:

  LinkStreamCall  read() -> the next response, grpc.aio.EOF after an OK end; raises LinkRpcError
                  (an AioRpcError) for an error end, asyncio.CancelledError once cancel()led;
                  read_nowait() -> the next response if already received, else None
  unary_unary     awaits the one response; LinkRpcError for an error end or DEADLINE_EXCEEDED
                  past its timeout (the call is cancelled on the worker then)

A broken connection ends every call on it with UNAVAILABLE; a worker that cannot be reached
or does not prove the secret fails the call with UNAVAILABLE or UNAUTHENTICATED at once.
Responses are kept per call until read: a caller that stops reading a stream should cancel it.
Not thread-safe: one event loop owns a channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import socket

import grpc
from google.protobuf.message import Message

from proto.limits import INTERNAL_MAX_MESSAGE_BYTES
from proto.link import handshake
from proto.link.coalesce import CoalescingWriter
from proto.link.frames import (
    MAX_CALL_ID, FrameKind, FrameReader, LinkProtocolError, LinkStatus, decode_status, frame)
from proto.link.calls import DEADLINE_EXCEEDED, Call, LinkRpcError, LinkStreamCall, UnaryCall
from proto.link.methods import ABORT, DECODE, PREFILL, LinkMethod

__all__ = ["LinkChannel", "LinkDecodeStub", "LinkPrefillStub", "LinkRpcError", "LinkStreamCall"]

CONNECT_TIMEOUT_S = handshake.HANDSHAKE_TIMEOUT_S


class LinkChannel:
    """Calls to one worker's link at `address` (host:port), proving `secret`."""

    def __init__(self, address: str, secret: bytes, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> None:
        if not secret:
            raise ValueError("the cluster secret is empty")
        self.address = address
        self._secret = secret
        self.connect_timeout_s = connect_timeout_s
        self.max_message_bytes = max_message_bytes
        self._connection: _ClientConnection | None = None
        self._connecting: asyncio.Future | None = None
        self.connects = 0
        """Connections opened so far (a count for tests and logs)."""

    # ------------------------------------------------------------------ calls
    def unary_stream(self, method: LinkMethod, request: Message) -> LinkStreamCall:
        """Start a streaming call (sent now when connected, else once the connection opens)."""
        call = LinkStreamCall(self, method.response)
        data = self._request_bytes(method, request, call)
        if data is not None:
            connection = self._connection
            if connection is not None and connection.open:
                connection.start(call, data)
            else:
                call.starting = asyncio.ensure_future(self._start_later(call, data))
        return call

    async def unary_unary(self, method: LinkMethod, request: Message, timeout: float | None = None) -> Message:
        """The call's one response; LinkRpcError for its error end or past `timeout` seconds."""
        call = UnaryCall(self, method.response)
        data = self._request_bytes(method, request, call)
        if data is None:
            raise call.error()
        connection = self._connection
        if connection is not None and connection.open:
            # The usual case: the deadline is one timer on the reply, not asyncio.timeout's task
            # bookkeeping (a router makes a Prefill call per request).
            connection.start(call, data)
            timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, call.expire)
            try:
                return await call.result()
            except asyncio.CancelledError:
                call.cancel()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        try:
            async with asyncio.timeout(timeout):
                connection = await self._connected()
                connection.start(call, data)
                return await call.result()
        except TimeoutError:
            call.cancel()
            raise LinkRpcError(DEADLINE_EXCEEDED, self.address) from None
        except asyncio.CancelledError:
            call.cancel()
            raise

    def _request_bytes(self, method: LinkMethod, request: Message, call: Call) -> bytes | None:
        """The CALL payload; None (the call ended RESOURCE_EXHAUSTED, as gRPC ends it) when the
        request is above the message limit."""
        data = request.SerializeToString()
        if len(data) > self.max_message_bytes:
            call.end(LinkStatus(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"Sent message larger than max ({len(data)} vs. {self.max_message_bytes})"))
            return None
        return bytes((method.id,)) + data

    async def _start_later(self, call: LinkStreamCall, data: bytes) -> None:
        try:
            connection = await self._connected()
        except LinkRpcError as exc:
            call.end(exc.status)
            return
        except Exception as exc:  # noqa: BLE001 (the call ends with it; nobody awaits this task)
            call.end(LinkStatus(grpc.StatusCode.UNAVAILABLE, f"worker link {self.address}: {exc}"))
            return
        if not call.done():
            connection.start(call, data)

    # ------------------------------------------------------------------ the connection
    async def _connected(self) -> _ClientConnection:
        """The open connection, opening one (shared by concurrent callers) when there is none;
        LinkRpcError UNAVAILABLE or UNAUTHENTICATED when that fails."""
        connection = self._connection
        if connection is not None and connection.open:
            return connection
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connect_done)
        return await asyncio.shield(self._connecting)

    def _connect_done(self, connecting: asyncio.Future) -> None:
        if self._connecting is connecting:
            self._connecting = None
        if not connecting.cancelled():
            connecting.exception()  # its awaiters raise it; none left must not log it as lost

    async def _open(self) -> _ClientConnection:
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        transport = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, connection = await loop.create_connection(
                    lambda: _ClientConnection(self), host.strip("[]"), int(port))
                await connection.opened
        except TimeoutError:
            if transport is not None:
                transport.close()
            raise self._unavailable(f"no link opening within {self.connect_timeout_s:g} s") from None
        except (OSError, ValueError) as exc:
            raise self._unavailable(f"cannot connect: {exc}") from None
        except LinkRpcError:
            if transport is not None:
                transport.close()
            raise
        self._connection = connection
        self.connects += 1
        return connection

    def _unavailable(self, reason: str) -> LinkRpcError:
        return LinkRpcError(LinkStatus(grpc.StatusCode.UNAVAILABLE, f"worker link {self.address}: {reason}"),
                            self.address)

    def _lost(self, connection: _ClientConnection) -> None:
        if self._connection is connection:
            self._connection = None

    async def close(self) -> None:
        """Close the connection; calls on it end UNAVAILABLE."""
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
            self._connecting = None
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    async def __aenter__(self) -> LinkChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class ConnectionState(enum.Enum):
    OPENING = "opening"
    OPEN = "open"
    CLOSED = "closed"


class _ClientConnection(asyncio.Protocol):
    """The caller's connection: the opening, then frames to and from its calls."""

    def __init__(self, channel: LinkChannel) -> None:
        self.channel = channel
        self.state = ConnectionState.OPENING
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self.calls: dict[int, Call] = {}
        self._ids = itertools.count(1)
        self._transport: asyncio.Transport | None = None
        self._writer: CoalescingWriter | None = None
        self._opening = bytearray()
        self._server_nonce = b""
        self._client_nonce = b""
        self._reader = FrameReader(channel.max_message_bytes + 16)

    @property
    def open(self) -> bool:
        return self.state is ConnectionState.OPEN and not self._transport.is_closing()

    def start(self, call: Call, data: bytes) -> None:
        call_id = next(self._ids) & MAX_CALL_ID
        while call_id == 0 or call_id in self.calls:  # after 2**32 calls on one connection
            call_id = next(self._ids) & MAX_CALL_ID
        call.connection, call.call_id = self, call_id
        self.calls[call_id] = call
        self._writer.write(frame(call_id, FrameKind.CALL, data))

    def cancel(self, call_id: int) -> None:
        if self.calls.pop(call_id, None) is not None and self.open:
            self._writer.write(frame(call_id, FrameKind.CANCEL))

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport) -> None:
        self._transport = transport
        self._writer = CoalescingWriter(transport, asyncio.get_running_loop())
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        if self.state is ConnectionState.OPENING:
            data = self._open(data)
            if not data:
                return
        try:
            frames = self._reader.feed(data)
        except LinkProtocolError as exc:
            self._fail_all(f"the worker broke the link's format ({exc})")
            self._transport.abort()
            return
        calls = self.calls
        for call_id, kind, payload in frames:
            if kind == FrameKind.MESSAGE:
                call = calls.get(call_id)
                if call is not None:  # else: cancelled here, the worker had sent it already
                    call.on_message(payload)
            elif kind == FrameKind.END:
                call = calls.pop(call_id, None)
                if call is not None:
                    try:
                        call.end(decode_status(payload))
                    except LinkProtocolError as exc:
                        call.end(LinkStatus(grpc.StatusCode.INTERNAL, str(exc)))
            else:
                self._fail_all(f"the worker sent a {FrameKind(kind).name} frame")
                self._transport.abort()
                return

    def connection_lost(self, exc: Exception | None) -> None:
        was_open = self.state is ConnectionState.OPEN
        self.state = ConnectionState.CLOSED
        self.channel._lost(self)
        if not self.opened.done():
            reason = "the worker closed the link during its opening (wrong cluster secret?)"
            code = grpc.StatusCode.UNAUTHENTICATED if self._server_nonce else grpc.StatusCode.UNAVAILABLE
            self.opened.set_exception(LinkRpcError(LinkStatus(code, f"worker link {self.channel.address}: {reason}"),
                                                   self.channel.address))
        if was_open:
            self._fail_all(f"connection lost ({exc or 'closed by the worker'})")

    def _fail_all(self, reason: str) -> None:
        status = LinkStatus(grpc.StatusCode.UNAVAILABLE, f"worker link {self.channel.address}: {reason}")
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.end(status)

    # ------------------------------------------------------------------ opening
    def _open(self, data: bytes) -> bytes:
        """Consume HELLO (then send PROOF) and ACCEPT; the bytes after them, or b""."""
        self._opening += data
        if not self._server_nonce:
            if len(self._opening) < handshake.HELLO_BYTES:
                return b""
            hello = bytes(self._opening[:handshake.HELLO_BYTES])
            del self._opening[:handshake.HELLO_BYTES]
            nonce = handshake.nonce_of_hello(hello)
            if nonce is None:
                self._refuse(grpc.StatusCode.UNAVAILABLE, "the port did not answer as a pdserve worker link")
                return b""
            self._server_nonce = nonce
            proof, self._client_nonce = handshake.proof_for(self.channel._secret, nonce)
            self._transport.write(proof)
        if len(self._opening) < handshake.ACCEPT_BYTES:
            return b""
        accept = bytes(self._opening[:handshake.ACCEPT_BYTES])
        rest = bytes(self._opening[handshake.ACCEPT_BYTES:])
        self._opening.clear()
        if not handshake.check_accept(self.channel._secret, self._server_nonce, self._client_nonce, accept):
            self._refuse(grpc.StatusCode.UNAUTHENTICATED, "the worker did not prove the cluster secret")
            return b""
        self.state = ConnectionState.OPEN
        if not self.opened.done():
            self.opened.set_result(None)
        return rest

    def _refuse(self, code: grpc.StatusCode, reason: str) -> None:
        if not self.opened.done():
            self.opened.set_exception(LinkRpcError(LinkStatus(code, f"worker link {self.channel.address}: {reason}"),
                                                   self.channel.address))
        self.close()


class LinkDecodeStub:
    """DecodeWorkerStub's calls that the router makes, over a link."""

    def __init__(self, channel: LinkChannel) -> None:
        self._channel = channel

    def Decode(self, request, timeout: float | None = None) -> LinkStreamCall:  # noqa: N802 (the RPC's name)
        return self._channel.unary_stream(DECODE, request)

    async def Abort(self, request, timeout: float | None = None):  # noqa: N802
        return await self._channel.unary_unary(ABORT, request, timeout)


class LinkPrefillStub:
    """PrefillWorkerStub's calls that the router makes, over a link."""

    def __init__(self, channel: LinkChannel) -> None:
        self._channel = channel

    async def Prefill(self, request, timeout: float | None = None):  # noqa: N802
        return await self._channel.unary_unary(PREFILL, request, timeout)

    async def Abort(self, request, timeout: float | None = None):  # noqa: N802
        return await self._channel.unary_unary(ABORT, request, timeout)
