"""gRPC DecodeWorker servicer: decode the message, call the worker, encode the answer."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from decode_worker.worker import DecodeDraining, DecodeWorker, StreamFailed
from proto.convert import logprobs_to_proto, params_from_proto
from proto.log_context import set_request_id
from proto.limits import NO_ROOM_METADATA_KEY
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from worker_runtime.status import WorkerStatus

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


DrainHook = Callable[[float | None], tuple[bool, int]]
"""Starts the process-level drain (timeout in s; None: the worker's --drain-timeout) and
returns at once with (started: False when already draining, requests in flight)."""


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, address: str, request_drain: DrainHook | None = None) -> None:
        self.worker = worker
        self.address = address
        self.request_drain = request_drain

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        set_request_id(request.request_id)  # this call's log lines name the request (JSON logs)
        try:
            params = params_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            ticket, outputs = await self.worker.admit(
                request.request_id, tuple(request.prompt_token_ids), params,
                ticket_timeout_s(request.ticket_timeout_ms), local_prefill=request.local_prefill,
                stream_first_token=request.stream_first_token)
        except DecodeDraining as exc:  # the router tries the next decode worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:  # too long, duplicate id
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if ticket is None:
            core = self.worker.status().core
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"decode worker {self.worker.worker_id} has no room now: {core.free_blocks} of "
                f"{core.total_blocks} blocks free, {core.num_running} running",
                trailing_metadata=((NO_ROOM_METADATA_KEY, "1"),),
            )
        finished = False
        try:
            yield worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(
                ticket_id=ticket.ticket_id, decode_worker_id=self.worker.worker_id,
                decode_address=self.address, num_cached_tokens=ticket.num_cached_tokens,
                num_blocks=ticket.num_blocks, incarnation=self.worker.incarnation,
                # the router drops the stream's first token by position when it has it already
                first_token_on_stream=request.stream_first_token and not request.local_prefill))
            while not finished:
                output = await outputs.get()
                if isinstance(output, StreamFailed):  # the worker already ended it and freed it
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(output))
                finished = output.finish_reason is not None
                chunk = worker_pb2.TokenChunk(
                    token_ids=list(output.new_token_ids),
                    logprobs=[logprobs_to_proto(output.logprobs)] if output.logprobs else [],
                    finish_reason=output.finish_reason or "",
                    stop_token_id=output.stop_reason if isinstance(output.stop_reason, int) else -1,
                    sampled_at=[output.sampled_at] * len(output.new_token_ids) if output.sampled_at else [],
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
        return load_report(self.worker.status())

    async def Drain(self, request, context):
        return await answer_drain(self.request_drain, request, context)


def load_report(status: WorkerStatus) -> worker_pb2.LoadReport:
    s = status.core
    return worker_pb2.LoadReport(
        worker_id=status.worker_id, incarnation=status.incarnation, role=status.role,
        block_size=status.block_size, total_blocks=s.total_blocks,
        free_blocks=s.free_blocks, reserved_blocks=s.reserved_blocks, cached_blocks=s.cached_blocks,
        num_running=s.num_running, num_waiting=s.num_waiting,
        queued_prefill_tokens=s.queued_prefill_tokens, state=status.state.value,
        in_flight=status.in_flight,
    )


async def answer_drain(request_drain: DrainHook | None, request: worker_pb2.DrainRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:
    """The Drain RPC of either role: start the process's drain through its hook, answer at once."""
    if request_drain is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "this worker was started without a drain hook (it is not a worker process)")
    timeout_s = request.timeout_ms / 1000 if request.HasField("timeout_ms") else None
    started, in_flight = request_drain(timeout_s)
    return worker_pb2.DrainResponse(started=started, in_flight=in_flight)
