"""Device, dtype and thread choices for one process."""

from __future__ import annotations

import functools
import os

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any("avx512_bf16" in line for line in f if line.startswith("flags"))
    except OSError:
        return False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPU or on CPUs with native bf16 (avx512_bf16), else float32."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_avx512_bf16():
            return torch.bfloat16
        return torch.float32
    return TORCH_DTYPES[name]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """(name used in capacity math, torch dtype of the cache tensors)."""
    if name == "auto":
        return str(model_dtype).removeprefix("torch."), model_dtype
    if name == "fp8":
        return "fp8", torch.float8_e4m3fn
    return name, TORCH_DTYPES[name]


def set_num_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (default: every core this process may run on)."""
    threads = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads


def available_memory_bytes(device: torch.device) -> int:
    """Memory the process could still use: free device memory on GPU, MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
