"""The router's Drain call to one worker (the gRPC half of POST /v1/workers/{id}/drain).

Drain returns at once on the worker (it finishes its in-flight requests, then exits), so the
call is bounded like the other control call, Abort (router.routing.worker_calls.WorkerTimeouts.abort_s).
The channel comes from the ClusterBackend's pool: internal, proving the cluster secret.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.cluster.keys import WorkerInfo
from router.errors import WorkerFailure
from router.ops.roles import DrainOutcome


class WorkerDrainer:
    """Calls Drain on a worker's own service: DecodeWorker for decode (and "both"), else
    PrefillWorker. Raises WorkerFailure naming the worker and gRPC's code when the call fails."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
        self._channel = channel
        self._timeout_s = timeout_s

    async def __call__(self, worker: WorkerInfo) -> DrainOutcome:
        channel = self._channel(worker.address)
        stub = (worker_pb2_grpc.DecodeWorkerStub(channel) if worker.serves_decode
                else worker_pb2_grpc.PrefillWorkerStub(channel))
        try:
            reply = await stub.Drain(worker_pb2.DrainRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise WorkerFailure(f"Drain on {worker.role} worker {worker.worker_id} failed: "
                                f"{exc.code().name}: {exc.details()}") from None
        return DrainOutcome(worker.worker_id, reply.started, reply.in_flight)
