"""The registered roles (worker_runtime/roles.py): how each worker is built from a WorkerSpec.

Imported only when a role is looked up, since building loads torch and the model.
Every call into the worker services must prove the cluster secret (proto/internal_auth.py); the
secret also admits a prefill worker to a KV data channel (kv_transfer/wire.py), through
TransferConfig.secret.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from decode_worker.servicer import DecodeWorkerServicer
from decode_worker.worker import DecodeWorker
from engine.core import EngineCore
from kv_transfer.base import KV_TRANSFER_BACKENDS, ChannelAddress, TransferConfig
from kv_transfer.pool import ChannelPool
from prefill_worker.openings import CHANNEL_LANES
from prefill_worker.servicer import PrefillWorkerServicer
from prefill_worker.worker import PrefillWorker
from proto.internal_auth import internal_channel
from proto.link import methods as link_methods
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from worker_runtime.roles import RoleDef

if TYPE_CHECKING:  # the spec is pdserve's; the runtime only reads its fields
    from pdserve.specs import WorkerSpec

__all__ = ["DECODE", "PREFILL", "build_decode", "build_prefill", "open_channel_via_grpc"]


def transfer_config(spec: WorkerSpec, secret: bytes, core: EngineCore) -> TransferConfig:
    """The data channel binds and advertises the advertised host (gloo tells its peer the
    address it bound), so a worker bound to 0.0.0.0 still gives peers a dialable one. A GPU
    backend's buffers are on the engine's device; the others' in host memory."""
    on_gpu = KV_TRANSFER_BACKENDS.get(spec.kv_transfer).on_engine_device
    return TransferConfig(host=spec.advertised_host, timeout_s=spec.transfer_timeout_s, secret=secret,
                          device=str(core.device) if on_gpu else "cpu")


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


def build_decode(spec: WorkerSpec, secret: bytes) -> DecodeWorker:
    core = EngineCore(spec.engine)
    transfer = transfer_config(spec, secret, core)
    # Idle receive buffers kept for reuse never outgrow the KV cache they are unpacked into.
    kv_bytes = core.capacity.num_blocks * core.capacity.bytes_per_block
    transfer = replace(transfer, recv_buffer_pool_bytes=min(transfer.recv_buffer_pool_bytes, kv_bytes))
    receiver = KV_TRANSFER_BACKENDS.get(spec.kv_transfer)(transfer).open_receiver()
    return DecodeWorker(core, receiver, worker_id=spec.worker_id)


def build_prefill(spec: WorkerSpec, secret: bytes) -> PrefillWorker:
    core = EngineCore(spec.engine.for_prefill_worker(), hold_finished_blocks=True)
    transfer = transfer_config(spec, secret, core)
    worker: PrefillWorker | None = None

    async def opener(address: str) -> ChannelAddress:
        assert worker is not None, "a channel is opened only by a request, after construction"
        return await open_channel_via_grpc(address, worker.worker_id, worker.incarnation, spec.kv_transfer,
                                           secret)

    backend = KV_TRANSFER_BACKENDS.get(spec.kv_transfer)(transfer)
    lanes = CHANNEL_LANES if spec.kv_transfer == "gloo" else 1  # an NCCL group costs GPU memory
    worker = PrefillWorker(core, ChannelPool(backend, lanes=lanes), opener, worker_id=spec.worker_id,
                           backend_name=spec.kv_transfer, transfer_timeout_s=spec.transfer_timeout_s)
    return worker


def prefill_servicer(worker, address: str, request_drain) -> PrefillWorkerServicer:
    return PrefillWorkerServicer(worker, request_drain=request_drain)  # tickets carry D's address


def decode_servicer(worker, address: str, request_drain) -> DecodeWorkerServicer:
    return DecodeWorkerServicer(worker, address, request_drain=request_drain)  # put in its tickets


PREFILL = RoleDef(
    name="prefill",
    service_name="pdserve.v1.PrefillWorker",
    build=build_prefill,
    servicer=PrefillWorkerServicer,
    make_servicer=prefill_servicer,
    add_to_server=worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
    link_methods=(link_methods.PREFILL, link_methods.ABORT),
)
DECODE = RoleDef(
    name="decode",
    service_name="pdserve.v1.DecodeWorker",
    build=build_decode,
    servicer=DecodeWorkerServicer,
    make_servicer=decode_servicer,
    add_to_server=worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
    link_methods=(link_methods.DECODE, link_methods.ABORT),
)
