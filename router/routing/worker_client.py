"""The router's connections to its workers: one pooled channel per worker address, its stubs
built once (a stub builds a callable per method, and the proving channel wraps each: per
request that was measurable in benchmarks/router_overhead.py), and best-effort aborts.

Decode, Prefill and Abort go over a worker's link (proto/link: one multiplexed connection, a
tenth of a gRPC call's CPU) when the worker advertises one and the client uses links; else over
gRPC. Both kinds of stub have the same calls, and a link call fails as a gRPC call does
(AioRpcError), so callers do not know which they hold. Everything else (drain, load) is gRPC.

Every call carries the cluster secret's proof (proto/internal_auth.py, proto/link/handshake.py)
unless the client was made without a secret (tests whose workers are in-process doubles
without the check; such a client never uses links).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto.internal_auth import internal_channel
from proto.link import LinkChannel, LinkDecodeStub, LinkPrefillStub
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class WorkerClient:
    """Channels and stubs by worker address; aborts; background calls nobody awaits.
    Not thread-safe: one event loop owns it."""

    def __init__(self, secret: bytes | None, use_links: bool = True) -> None:
        """use_links False: every call over gRPC, even to workers that serve a link."""
        self._secret = secret
        self.use_links = use_links and secret is not None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._links: dict[str, LinkChannel] = {}
        self._decode: dict[str, worker_pb2_grpc.DecodeWorkerStub | LinkDecodeStub] = {}
        self._prefill: dict[str, worker_pb2_grpc.PrefillWorkerStub | LinkPrefillStub] = {}
        self._background: set[asyncio.Task] = set()
        """Aborts sent to silent workers, not awaited by the request they end."""

    def channel(self, address: str) -> grpc.aio.Channel:
        """The pooled channel to a worker; closed by close()."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = (
                grpc.aio.insecure_channel(address) if self._secret is None
                else internal_channel(address, self._secret))
        return channel

    def link(self, link_address: str) -> LinkChannel:
        """The pooled link to a worker's link address; closed by close()."""
        link = self._links.get(link_address)
        if link is None:
            link = self._links[link_address] = LinkChannel(link_address, self._secret)
        return link

    def decode(self, address: str, link_address: str = "") -> worker_pb2_grpc.DecodeWorkerStub | LinkDecodeStub:
        """The decode calls of the worker at gRPC `address`: over its link when it has one
        (`link_address`) and links are in use, else over gRPC."""
        linked = bool(link_address) and self.use_links
        stub = self._decode.get(link_address if linked else address)
        if stub is None:
            stub = (LinkDecodeStub(self.link(link_address)) if linked
                    else worker_pb2_grpc.DecodeWorkerStub(self.channel(address)))
            self._decode[link_address if linked else address] = stub
        return stub

    def prefill(self, address: str, link_address: str = "") -> worker_pb2_grpc.PrefillWorkerStub | LinkPrefillStub:
        """The prefill calls of the worker at gRPC `address` (see decode)."""
        linked = bool(link_address) and self.use_links
        stub = self._prefill.get(link_address if linked else address)
        if stub is None:
            stub = (LinkPrefillStub(self.link(link_address)) if linked
                    else worker_pb2_grpc.PrefillWorkerStub(self.channel(address)))
            self._prefill[link_address if linked else address] = stub
        return stub

    async def abort(self, address: str, request_id: str, timeout_s: float, prefill: bool = False,
                    link_address: str = "") -> None:
        """Abort on one worker; a worker that is gone or does not answer is logged, not raised
        (it holds nothing for the request then, or its own deadlines free it)."""
        stub = self.prefill(address, link_address) if prefill else self.decode(address, link_address)
        try:
            await stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.info("abort of %s on %s failed: %s", request_id, address, exc.code().name)

    def in_background(self, coro) -> None:
        """Run `coro` without awaiting it; close() cancels what is left."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for channel in [*self._channels.values(), *self._links.values()]:
            await channel.close()
        self._channels.clear()
        self._links.clear()
        self._decode.clear()
        self._prefill.clear()
