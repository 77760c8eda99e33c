"""The shared path of the torch.distributed backends: one 2-rank process group per P<->D
channel, built lazily through a TCPStore rendezvous hosted by D (protocol: wire.py).

Subclasses (gloo.py, nccl.py) say only how to build a group and which tensors it carries.
Groups are constructed directly (no init_process_group), so many coexist in one process.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch.distributed import ProcessGroup, Store

from engine.openmp import one_openmp_thread_here
from kv_transfer.base import ChannelAddress, KVTransferBackend, TransferConfig
from kv_transfer.torch_dist_receiver import TorchDistReceiver
from kv_transfer.torch_dist_sender import TorchDistSender


class TorchDistBackend(KVTransferBackend):
    name = "torch_dist"

    def __init__(self, config: TransferConfig) -> None:
        if config.secret is None:
            raise ValueError(f"the {self.name} KV transfer backend needs the cluster secret "
                             "(TransferConfig.secret): D admits only peers that prove it")
        super().__init__(config)

    def open_receiver(self) -> TorchDistReceiver:
        """Hosts a TCPStore on a free port of config.host (D side)."""
        return TorchDistReceiver(self)

    def connect(self, address: ChannelAddress) -> TorchDistSender:
        return TorchDistSender(self, address)

    @abstractmethod
    def make_group(self, store: Store, rank: int) -> ProcessGroup:
        """Join the channel's 2-rank group. Blocks until both ranks joined or
        connect_timeout_s passed (then raises RuntimeError). Called on the channel's thread."""

    @abstractmethod
    def wire_device(self, device: torch.device) -> torch.device:
        """Where this backend sends a tensor on `device` from (gloo: host memory, a GPU's KV is
        copied there on the channel's thread); raises ValueError when it cannot send it."""

    def prepare_thread(self) -> None:
        """Called first on every channel thread: one OpenMP thread (engine.openmp: the engine
        loop's pool is the process's only one); NCCL also selects the device."""
        one_openmp_thread_here()
