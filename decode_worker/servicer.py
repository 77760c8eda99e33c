"""gRPC DecodeWorker servicer: decode the message, call the worker, encode the answer."""

from __future__ import annotations

import grpc

from decode_worker.worker import DecodeWorker
from proto.convert import logprobs_to_proto, params_from_proto
from proto.limits import NO_ROOM_METADATA_KEY
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

DEFAULT_TICKET_TIMEOUT_S = 60.0
"""A ticket's lifetime when the caller asks for none (ticket_timeout_ms 0 or absent)."""
MAX_TICKET_TIMEOUT_S = 120.0
"""The longest a caller may make this worker hold a reservation for a prefill that has not
arrived: larger requests are clamped, so no caller can pin blocks for an hour."""


def ticket_timeout_s(requested_ms: int) -> float:
    """The ticket lifetime this worker grants for a requested one (0: the default)."""
    if not requested_ms:
        return DEFAULT_TICKET_TIMEOUT_S
    return min(requested_ms / 1000, MAX_TICKET_TIMEOUT_S)


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, address: str) -> None:
        self.worker = worker
        self.address = address

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        try:
            params = params_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            ticket, outputs = await self.worker.admit(
                request.request_id, tuple(request.prompt_token_ids), params,
                ticket_timeout_s(request.ticket_timeout_ms), local_prefill=request.local_prefill)
        except ValueError as exc:  # too long, duplicate id
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if ticket is None:
            stats = self.worker.loop.stats
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode worker {self.worker.worker_id} has no room now: {stats.free_blocks} of "
                f"{stats.total_blocks} blocks free, {stats.num_running} running",
                trailing_metadata=((NO_ROOM_METADATA_KEY, "1"),),
            )
        finished = False
        try:
            yield worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(
                ticket_id=ticket.ticket_id, decode_worker_id=self.worker.worker_id,
                decode_address=self.address, num_cached_tokens=ticket.num_cached_tokens,
                num_blocks=ticket.num_blocks, incarnation=self.worker.incarnation))
            while not finished:
                output = await outputs.get()
                finished = output.finish_reason is not None
                chunk = worker_pb2.TokenChunk(
                    token_ids=list(output.new_token_ids),
                    logprobs=[logprobs_to_proto(output.logprobs)] if output.logprobs else [],
                    finish_reason=output.finish_reason or "",
                    stop_token_id=output.stop_reason if isinstance(output.stop_reason, int) else -1,
                )
                yield worker_pb2.DecodeEvent(tokens=chunk)
        finally:
            if not finished:  # the router went away mid-stream: free everything
                await self.worker.abort(request.request_id)

    async def OpenChannel(self, request, context):
        address = self.worker.open_channel()
        return worker_pb2.OpenChannelResponse(
            store_host=address.host, store_port=address.port, channel_id=address.channel_id)

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def GetLoad(self, request, context):
        return load_report(self.worker, "decode")


def load_report(worker, role: str) -> worker_pb2.LoadReport:
    s = worker.loop.stats
    return worker_pb2.LoadReport(
        worker_id=worker.worker_id, incarnation=worker.incarnation, role=role,
        block_size=worker.core.config.block_size, total_blocks=s.total_blocks,
        free_blocks=s.free_blocks, reserved_blocks=s.reserved_blocks, cached_blocks=s.cached_blocks,
        num_running=s.num_running, num_waiting=s.num_waiting,
        queued_prefill_tokens=s.queued_prefill_tokens,
    )
