"""The P/D cluster as a GenerationBackend: decode reserves, prefill pushes, decode streams.

For one backend request:
  1. choose (prefill, decode) from the cluster snapshot (a pure policy);
  2. Decode RPC on the decode worker -> first event is the ticket, or RESOURCE_EXHAUSTED
     (then the next decode worker is tried; none left -> Overloaded, 503);
  3. Prefill RPC with the ticket on the prefill worker -> first token; a prefill worker
     that fails is replaced by the next one with the same ticket;
  4. the first token goes to the client, then the decode stream's tokens.
Leaving early (client gone, stop string, error) aborts the request on both workers.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from proto.convert import params_to_proto
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.backend import BackendRequest, TokenDelta
from router.cluster_state import ClusterSnapshot
from router.errors import InvalidRequest, Overloaded, WorkerFailure
from router.policy import RouteDecision, RouteRequest
from router.types import TokenLogprobs

logger = logging.getLogger(__name__)

PATH_DISAGGREGATED = "disaggregated"
PATH_COLOCATED = "colocated"


@dataclass
class TransferTotals:
    """KV transfers as reported by prefill workers (for the router's /metrics)."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    prefill_retries: int = 0
    decode_rejections: int = 0


@dataclass
class _Placement:
    decode_address: str
    prefill_address: str | None = None


def _logprobs(msg) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


class ClusterBackend:
    def __init__(
        self,
        snapshot: Callable[[], "object"],
        choose: Callable[[RouteRequest, ClusterSnapshot, random.Random], RouteDecision | None],
        ticket_timeout_s: float = 60.0,
        rng: random.Random | None = None,
    ) -> None:
        self._snapshot = snapshot  # async () -> ClusterSnapshot
        self._choose = choose
        self._ticket_timeout_ms = int(ticket_timeout_s * 1000)
        self._rng = rng or random.Random()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._placements: dict[str, _Placement] = {}
        self.transfers = TransferTotals()
        self.last_decision: RouteDecision | None = None

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def generate(self, request: BackendRequest) -> AsyncIterator[TokenDelta]:
        snapshot = await self._snapshot()
        route = RouteRequest(len(request.prompt_token_ids), request.params.max_tokens)
        decision = self._choose(route, snapshot, self._rng)
        if decision is None:
            raise Overloaded("no decode worker is registered", retry_after_s=1.0)
        self.last_decision = decision
        logger.debug("route %s: %s %s", request.request_id, decision.reason, decision.inputs)
        finished = False
        local = decision.prefill_id is None  # no prefill worker: the decode worker does it all
        path = PATH_COLOCATED if local else PATH_DISAGGREGATED
        try:
            stream, ticket = await self._admit(request, snapshot, decision, local)
            if not local:
                yield await self._prefill(request, snapshot, decision, ticket)
            while (event := await stream.read()) is not grpc.aio.EOF:  # read() only: no mixing
                chunk = event.tokens
                delta = TokenDelta(
                    token_ids=tuple(chunk.token_ids),
                    logprobs=tuple(_logprobs(lp) for lp in chunk.logprobs),
                    finish_reason=chunk.finish_reason or None,
                    stop_token_id=chunk.stop_token_id if chunk.stop_token_id >= 0 else None,
                    path=path,
                )
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
            raise WorkerFailure("the decode worker ended the stream before the request finished")
        except grpc.aio.AioRpcError as exc:
            raise WorkerFailure(f"decode worker failed mid-stream: {exc.code().name}: {exc.details()}") from exc
        finally:
            if not finished:
                await self.abort(request.request_id)
            self._placements.pop(request.request_id, None)

    async def _admit(self, request: BackendRequest, snapshot: ClusterSnapshot, decision: RouteDecision,
                     local: bool):
        """Decode call on the chosen decode worker, then the others; returns (stream, ticket)."""
        candidates = [decision.decode_id] + [
            w.worker_id for w in snapshot.decode_workers() if w.worker_id != decision.decode_id]
        for worker_id in candidates:
            info = snapshot.by_id(worker_id)
            if info is None:
                continue
            stub = worker_pb2_grpc.DecodeWorkerStub(self._channel(info.address))
            stream = stub.Decode(worker_pb2.DecodeRequest(
                request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                sampling=params_to_proto(request.params), ticket_timeout_ms=self._ticket_timeout_ms,
                local_prefill=local))
            self._placements[request.request_id] = _Placement(info.address)
            try:
                first = await stream.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.transfers.decode_rejections += 1
                    continue
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(exc.details() or "invalid request") from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                raise WorkerFailure(f"decode worker {worker_id}: {exc.code().name}: {exc.details()}") from exc
            if first is grpc.aio.EOF or not first.HasField("ticket"):
                raise WorkerFailure(f"decode worker {worker_id} answered without a ticket")
            return stream, first.ticket
        self._placements.pop(request.request_id, None)
        raise Overloaded("every decode worker is full; retry shortly", retry_after_s=1.0)

    async def _prefill(self, request, snapshot: ClusterSnapshot, decision: RouteDecision, ticket) -> TokenDelta:
        ordered = [w.worker_id for w in snapshot.prefill_workers()]
        if decision.prefill_id in ordered:
            ordered.remove(decision.prefill_id)
            ordered.insert(0, decision.prefill_id)
        errors = []
        for worker_id in ordered:
            info = snapshot.by_id(worker_id)
            if info is None:
                continue
            self._placements[request.request_id].prefill_address = info.address
            stub = worker_pb2_grpc.PrefillWorkerStub(self._channel(info.address))
            try:
                reply = await stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                    sampling=params_to_proto(request.params), ticket=ticket))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(exc.details() or "invalid request") from exc
                errors.append(f"{worker_id}: {exc.code().name}: {exc.details()}")
                self.transfers.prefill_retries += 1
                logger.warning("prefill on %s failed (%s); trying the next prefill worker", worker_id, exc.code().name)
                continue
            self.transfers.count += 1
            self.transfers.nbytes += reply.transfer.bytes
            self.transfers.seconds += reply.transfer.seconds
            return TokenDelta(
                token_ids=(reply.first_token_id,),
                logprobs=(_logprobs(reply.first_logprobs),) if reply.HasField("first_logprobs") else (),
                num_cached_tokens=max(ticket.num_cached_tokens, reply.num_cached_tokens),
                path=PATH_DISAGGREGATED,
            )
        raise WorkerFailure("no prefill worker could serve the request: " + "; ".join(errors or ["none registered"]))

    async def abort(self, request_id: str) -> None:
        placement = self._placements.pop(request_id, None)
        if placement is None:
            return
        calls = [(worker_pb2_grpc.DecodeWorkerStub, placement.decode_address)]
        if placement.prefill_address:
            calls.append((worker_pb2_grpc.PrefillWorkerStub, placement.prefill_address))
        for stub_type, address in calls:
            try:
                await stub_type(self._channel(address)).Abort(
                    worker_pb2.AbortRequest(request_id=request_id), timeout=5)
            except grpc.aio.AioRpcError as exc:  # the worker may be gone; nothing to free there
                logger.info("abort of %s on %s failed: %s", request_id, address, exc.code().name)
