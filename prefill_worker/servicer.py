"""gRPC PrefillWorker servicer: decode the message, call the worker, encode the answer."""

from __future__ import annotations

import grpc

from decode_worker.servicer import DrainHook, answer_drain, load_report
from prefill_worker.worker import (
    DecodeTarget, PrefillDrained, PrefillDraining, PrefillWorker, TransferFailed,
)
from proto.convert import logprobs_to_proto, params_from_proto
from proto.log_context import set_request_id
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, request_drain: DrainHook | None = None) -> None:
        self.worker = worker
        self.request_drain = request_drain

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        set_request_id(request.request_id)  # this call's log lines name the request (JSON logs)
        try:
            params = params_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        t = request.ticket
        target = DecodeTarget(t.decode_address, t.incarnation, t.ticket_id, t.num_cached_tokens, t.num_blocks)
        try:
            result = await self.worker.prefill(request.request_id, tuple(request.prompt_token_ids), params, target)
        except (PrefillDraining, PrefillDrained) as exc:  # the router tries the next prefill worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except TransferFailed as exc:  # not delivered (or drained): the router tries another
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        response = worker_pb2.PrefillResponse(
            first_token_id=result.first_token_id,
            num_cached_tokens=result.num_cached_tokens,
            transfer=worker_pb2.TransferStats(
                bytes=result.nbytes, seconds=result.seconds, num_blocks=result.num_blocks,
                backend=self.worker.backend_name, wire_seconds=result.wire_seconds),
            timing=worker_pb2.PrefillTiming(queue_s=result.queue_s, compute_s=result.compute_s,
                                            first_token_at=result.first_token_at),
        )
        if result.first_logprobs is not None:
            response.first_logprobs.CopyFrom(logprobs_to_proto(result.first_logprobs))
        return response

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=await self.worker.abort(request.request_id))

    async def GetLoad(self, request, context):
        return load_report(self.worker.status())

    async def Drain(self, request, context):
        return await answer_drain(self.request_drain, request, context)
