"""nccl backend: CUDA tensors over NCCL, one ProcessGroupNCCL per P<->D channel.

The same path as gloo (torch_dist); only the group and the device differ. Constructing it
without a GPU raises RuntimeError at once. NCCL takes one rank per device: a prefill and a
decode worker on the same GPU cannot form a channel (ncclInvalidUsage, seen on an H100 with
benchmarks/gpu_check.py), so each needs a GPU of its own; cuda_ipc is the one-GPU backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Store

from kv_transfer.base import TransferConfig
from kv_transfer.torch_dist import TorchDistBackend
from kv_transfer.wire import seconds


class NcclBackend(TorchDistBackend):
    name = "nccl"
    on_engine_device = True

    def __init__(self, config: TransferConfig = TransferConfig(device="cuda:0")) -> None:
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise RuntimeError(
                "the nccl kv transfer backend needs a CUDA device and a torch built with NCCL "
                f"(cuda available: {torch.cuda.is_available()}, nccl available: "
                f"{dist.is_nccl_available()}); use the 'gloo' backend on CPU")
        if torch.device(config.device).type != "cuda":
            raise ValueError(f"the nccl backend receives into a CUDA device, got {config.device!r}")
        super().__init__(config)

    def make_group(self, store: Store, rank: int) -> ProcessGroup:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = seconds(self.config.connect_timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, options)

    def wire_device(self, device: torch.device) -> torch.device:
        if device.type != "cuda":
            raise ValueError(f"the nccl backend sends CUDA tensors, got one on {device}")
        return device

    def prepare_thread(self) -> None:
        super().prepare_thread()
        torch.cuda.set_device(torch.device(self.config.device))
