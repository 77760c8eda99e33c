"""The router's connections to its workers: one pooled channel per worker address, its stubs
built once (a stub builds a callable per method, and the proving channel wraps each: per
request that was measurable in benchmarks/router_overhead.py), and best-effort aborts.

Every call carries the cluster secret's proof (proto/internal_auth.py) unless the client was
made without a secret (tests whose workers are in-process doubles without the check).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto.internal_auth import internal_channel
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class WorkerClient:
    """Channels and stubs by worker address; aborts; background calls nobody awaits.
    Not thread-safe: one event loop owns it."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._decode: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}
        self._prefill: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
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

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        stub = self._decode.get(address)
        if stub is None:
            stub = self._decode[address] = worker_pb2_grpc.DecodeWorkerStub(self.channel(address))
        return stub

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        stub = self._prefill.get(address)
        if stub is None:
            stub = self._prefill[address] = worker_pb2_grpc.PrefillWorkerStub(self.channel(address))
        return stub

    async def abort(self, address: str, request_id: str, timeout_s: float, prefill: bool = False) -> None:
        """Abort on one worker; a worker that is gone or does not answer is logged, not raised
        (it holds nothing for the request then, or its own deadlines free it)."""
        stub = self.prefill(address) if prefill else self.decode(address)
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
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._decode.clear()
        self._prefill.clear()
