"""A link call's state on the caller's side, shaped as grpc.aio's calls (see client.py).

A call holds the responses received and not yet read, and how it ended; the connection that
carries it (client.py) hands it frames, and the call tells that connection when it is cancelled.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
from google.protobuf.message import Message

from proto.link.frames import LinkStatus

__all__ = ["CANCELLED", "DEADLINE_EXCEEDED", "Call", "LinkRpcError", "LinkStreamCall", "UnaryCall"]

CANCELLED = LinkStatus(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
DEADLINE_EXCEEDED = LinkStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class LinkRpcError(grpc.aio.AioRpcError):
    """A link call's error end, as grpc.aio raises it (code(), details(), trailing_metadata())."""

    def __init__(self, status: LinkStatus, address: str) -> None:
        super().__init__(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
                         details=status.details, debug_error_string=f"worker link {address}")
        self.status = status


class Call:
    """A call's state on the caller's side: responses received and not read, and its end."""

    __slots__ = ("channel", "response_type", "connection", "call_id", "status", "locally_cancelled")

    def __init__(self, channel, response_type: type[Message]) -> None:
        self.channel, self.response_type = channel, response_type
        self.connection = None
        """The connection carrying it once sent (client.py); it is told of a cancel."""
        self.call_id = 0
        self.status: LinkStatus | None = None
        self.locally_cancelled = False

    def done(self) -> bool:
        return self.status is not None

    def on_message(self, payload: bytes) -> None:
        raise NotImplementedError

    def end(self, status: LinkStatus) -> None:
        raise NotImplementedError

    def error(self) -> LinkRpcError:
        return LinkRpcError(self.status, self.channel.address)

    def cancel(self) -> bool:
        """Cancel the call (a CANCEL to the worker when it was sent); False when it had ended."""
        if self.status is not None:
            return False
        self.locally_cancelled = True
        if self.connection is not None:
            self.connection.cancel(self.call_id)
        self.end(CANCELLED)
        return True


class LinkStreamCall(Call):
    """A unary-stream call (see the module docstring)."""

    __slots__ = ("_messages", "_waiter", "starting")

    def __init__(self, channel, response_type: type[Message]) -> None:
        super().__init__(channel, response_type)
        self._messages: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.starting: asyncio.Future | None = None
        """The connect-then-send of a call made while the channel had no open connection."""

    async def read(self, timeout_s: float | None = None):
        """The next response, grpc.aio.EOF at a clean end, or the end's LinkRpcError. With
        `timeout_s`: TimeoutError when nothing came within it (the call itself is left as is).
        The deadline is one timer on the wait, not asyncio.timeout's task bookkeeping (a
        router reads a stream a few times per request)."""
        while True:
            if self._messages:
                return self.response_type.FromString(self._messages.popleft())
            status = self.status
            if status is not None:
                if self.locally_cancelled:
                    raise asyncio.CancelledError()
                if status.code == grpc.StatusCode.OK:
                    return grpc.aio.EOF
                raise self.error()
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = None if timeout_s is None else loop.call_later(timeout_s, _time_out, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def arrival(self) -> asyncio.Future:
        """A future done once a response has been received or the call has ended (done at once
        when one is there already), so that a read then will not wait: a read can be raced
        against other work without a task of its own. It takes the place of a read's wait (one
        reader at a time); a read made later takes it back, and the future is then left as it is."""
        arrived = asyncio.get_running_loop().create_future()
        if self._messages or self.status is not None:
            arrived.set_result(None)
        else:
            self._waiter = arrived
        return arrived

    def read_nowait(self):
        """The next response if it has been received already, else None (without waiting, and
        never the end: read() tells that). A gRPC call has no such method."""
        if self._messages:
            return self.response_type.FromString(self._messages.popleft())
        return None

    def on_message(self, payload: bytes) -> None:
        self._messages.append(payload)
        self._wake()

    def end(self, status: LinkStatus) -> None:
        if self.status is None:
            self.status = status
            if self.locally_cancelled:
                self._messages.clear()
            self._wake()

    def cancel(self) -> bool:
        if self.starting is not None and not self.starting.done():
            self.starting.cancel()
        return super().cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _time_out(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class UnaryCall(Call):
    __slots__ = ("_payload", "_future")

    def __init__(self, channel, response_type: type[Message]) -> None:
        super().__init__(channel, response_type)
        self._payload: bytes | None = None
        self._future = asyncio.get_running_loop().create_future()

    async def result(self) -> Message:
        await self._future
        if self.status.code != grpc.StatusCode.OK:
            raise self.error()
        if self._payload is None:
            raise LinkRpcError(LinkStatus(grpc.StatusCode.INTERNAL, "the worker ended the call without a response"),
                               self.channel.address)
        return self.response_type.FromString(self._payload)

    def on_message(self, payload: bytes) -> None:
        self._payload = payload

    def expire(self) -> None:
        """Its deadline passed: the worker is told (CANCEL) and the call ends DEADLINE_EXCEEDED,
        as a gRPC call past its deadline does."""
        if self.status is None:
            if self.connection is not None:
                self.connection.cancel(self.call_id)
            self.end(DEADLINE_EXCEEDED)

    def end(self, status: LinkStatus) -> None:
        if self.status is None:
            self.status = status
            if not self._future.done():
                self._future.set_result(None)
