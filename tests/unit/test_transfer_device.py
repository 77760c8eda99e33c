"""Where a worker's data channel keeps its buffers: GPU backends (nccl, cuda_ipc) on the engine's
device, gloo in host memory whatever the engine's device (a GPU engine's KV is staged there).

Found on an H100 (benchmarks/gpu_check.py): every worker built its TransferConfig with the
default device "cpu", so `pdserve up --device cuda --kv-transfer cuda_ipc` (or nccl) exited at
start, and gloo refused a GPU engine's KV at the first transfer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_transfer.base import KV_TRANSFER_BACKENDS
from pdserve.specs import WorkerSpec
from worker_runtime.builders import transfer_config


def _spec(backend: str) -> WorkerSpec:
    return WorkerSpec(role="decode", worker_id="decode-0", kv_transfer=backend)


@pytest.mark.parametrize("backend, on_gpu", [("nccl", True), ("cuda_ipc", True), ("gloo", False),
                                             ("local", False)])
def test_each_backend_says_whether_its_buffers_live_on_the_engine_device(backend, on_gpu):
    assert KV_TRANSFER_BACKENDS.get(backend).on_engine_device is on_gpu


@pytest.mark.parametrize("backend, want", [("nccl", "cuda:1"), ("cuda_ipc", "cuda:1"), ("gloo", "cpu")])
def test_transfer_config_takes_a_gpu_engines_device_for_gpu_backends_only(backend, want):
    core = SimpleNamespace(device=torch.device("cuda", 1))
    config = transfer_config(_spec(backend), b"s" * 32, core)
    assert config.device == want
    assert config.secret == b"s" * 32


def test_a_cpu_engine_keeps_host_memory_for_every_backend():
    core = SimpleNamespace(device=torch.device("cpu"))
    for backend in ("gloo", "nccl", "cuda_ipc"):
        assert transfer_config(_spec(backend), b"s" * 32, core).device == "cpu"


def test_gloo_sends_from_host_memory_whatever_the_engines_device():
    from kv_transfer.base import TransferConfig
    from kv_transfer.gloo import GlooBackend

    backend = GlooBackend(TransferConfig(secret=b"s" * 32))
    for device in ("cpu", "cuda:0", "cuda:3"):
        assert backend.wire_device(torch.device(device)) == torch.device("cpu")


def test_nccl_refuses_a_host_tensor_with_the_reason():
    from kv_transfer.nccl import NcclBackend

    with pytest.raises(ValueError, match="the nccl backend sends CUDA tensors, got one on cpu"):
        NcclBackend.wire_device(None, torch.device("cpu"))  # the check reads nothing of the backend
    assert NcclBackend.wire_device(None, torch.device("cuda:1")) == torch.device("cuda:1")
