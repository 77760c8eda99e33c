"""Running one worker process: engine, KV transfer backend, gRPC server, until signalled.

Every call into the worker services must prove the cluster secret (proto/internal_auth.py);
health and reflection stay open for probes. The secret also admits a prefill worker to a KV
data channel (kv_transfer/wire.py), through TransferConfig.secret.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import EngineConfig
from engine.core import EngineCore
from kv_transfer.base import KV_TRANSFER_BACKENDS, ChannelAddress, TransferConfig
from proto.internal_auth import ClusterAuthServerInterceptor, internal_channel
from proto.limits import grpc_message_options
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


async def open_channel_via_grpc(decode_address: str, prefill_id: str, incarnation: str,
                                backend: str, secret: bytes, timeout_s: float = 30.0) -> ChannelAddress:
    """Ask a decode worker for a data channel (an authenticated call: the channel's id is
    what a rogue client of D's store would need)."""
    async with internal_channel(decode_address, secret) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        reply = await stub.OpenChannel(
            worker_pb2.OpenChannelRequest(prefill_worker_id=prefill_id, prefill_incarnation=incarnation,
                                          backend=backend),
            timeout=timeout_s,
        )
    return ChannelAddress(reply.store_host, reply.store_port, reply.channel_id)


def build_worker(role: str, config: EngineConfig, transfer: TransferConfig, backend_name: str):
    """A started worker object for `role` ("prefill" or "decode"). A prefill worker opens its
    channels with transfer.secret, the cluster secret (required)."""
    if role == "prefill" and transfer.secret is None:
        raise ValueError("a prefill worker needs the cluster secret (TransferConfig.secret)")
    if role == "decode":
        from decode_worker.worker import DecodeWorker

        core = EngineCore(config)
        # Idle receive buffers kept for reuse never outgrow the KV cache they are unpacked into.
        kv_bytes = core.capacity.num_blocks * core.capacity.bytes_per_block
        transfer = replace(transfer, recv_buffer_pool_bytes=min(transfer.recv_buffer_pool_bytes, kv_bytes))
        worker = DecodeWorker(core, KV_TRANSFER_BACKENDS.get(backend_name)(transfer).open_receiver())
    elif role == "prefill":
        from kv_transfer.pool import ChannelPool
        from prefill_worker.worker import PrefillWorker

        core = EngineCore(config, hold_finished_blocks=True)
        holder: dict = {}

        async def opener(address: str) -> ChannelAddress:
            w = holder["worker"]
            return await open_channel_via_grpc(address, w.worker_id, w.incarnation, backend_name,
                                               transfer.secret)

        backend = KV_TRANSFER_BACKENDS.get(backend_name)(transfer)
        worker = PrefillWorker(core, ChannelPool(backend), opener, backend_name=backend_name)
        holder["worker"] = worker
    else:
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    worker.start()
    return worker


async def serve(role: str, worker, host: str, port: int, secret: bytes,
                on_ready: Callable[[int], None] | None = None) -> None:
    """Serve `worker` over gRPC on host:port until SIGINT/SIGTERM; callers must prove `secret`."""
    # Message limits above anything the router accepts (a 2 MiB request's prompt, stops, logprobs).
    server = grpc.aio.server(interceptors=[ClusterAuthServerInterceptor(secret)], options=grpc_message_options())
    bound = server.add_insecure_port(f"{host}:{port}")
    address = f"{host}:{bound}"
    if role == "decode":
        from decode_worker.servicer import DecodeWorkerServicer

        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(worker, address), server)
        service_name = "pdserve.v1.DecodeWorker"
    else:
        from prefill_worker.servicer import PrefillWorkerServicer

        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillWorkerServicer(worker), server)
        service_name = "pdserve.v1.PrefillWorker"
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    await _set_serving(health_servicer, service_name)
    logger.info("%s worker %s serving gRPC on %s", role, worker.worker_id, address)
    if on_ready is not None:
        on_ready(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("%s worker %s stopping", role, worker.worker_id)
    await server.stop(grace=2)
    worker.stop()


async def _set_serving(health_servicer, service_name: str) -> None:
    for name in ("", service_name):
        result = health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if asyncio.iscoroutine(result):
            await result
