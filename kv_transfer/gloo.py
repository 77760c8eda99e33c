"""gloo backend: CPU tensors over TCP, one ProcessGroupGloo per P<->D channel."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup, ProcessGroupGloo, Store

from kv_transfer.torch_dist import TorchDistBackend
from kv_transfer.wire import seconds


class GlooBackend(TorchDistBackend):
    name = "gloo"

    def make_group(self, store: Store, rank: int) -> ProcessGroup:
        options = ProcessGroupGloo._Options()
        # Bind this side's sockets to config.host only, not to whatever the hostname resolves to.
        options._devices = [ProcessGroupGloo.create_device(hostname=self.config.host)]
        options._timeout = seconds(self.config.connect_timeout_s)
        return ProcessGroupGloo(store, rank, 2, options)

    def wire_device(self, device: torch.device) -> torch.device:
        # gloo sends host memory: a GPU engine's KV is staged there, and D's unpack copies it
        # onto its own device.
        return torch.device("cpu")
