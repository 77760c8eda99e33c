"""Device, dtype and thread choices for one process."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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


SMALL_STEP_TOKENS = 4
"""A step of at most this many tokens is a small decode step (StepThreads.small)."""


@dataclass(frozen=True)
class StepThreads:
    """Intra-op threads per engine step: `small` for a step of at most `small_tokens` tokens
    (decode at batch 1-4), `full` for the rest (prefill chunks, larger batches). By default
    both are every thread; --decode-threads gives small steps fewer (a host whose cores the
    router and clients share can prefer that).

    A batch-1 step is ~120 OpenMP regions of tens of microseconds each, so it pays for every
    wake-up of a helper thread. Until 2026-11-28 the default was one thread for small steps:
    served, two threads measured 36 ms/token against 24 on one (2026-11-27), but the cause was
    a second OpenMP pool in the worker, which keeps helpers from spinning between regions
    (engine.openmp). With one pool, on the 2-core EPYC, served colocated batch-1 decode
    (--quantization gguf --int4-activations int8): 7.2-8.2 ms/token on two threads against
    9.3-9.4 on one; 8 streams of short chats the same on both (24-27 ms mean ITL).
    Switching re-forms the thread team (milliseconds), so the runner switches only when the kind
    of step changes, not every step. The C int4/Q8_0 kernels (engine.cpu_kernels.int4_matmul)
    follow the same setting: one region a call, on the calling thread's team."""

    full: int
    small: int
    small_tokens: int = SMALL_STEP_TOKENS

    def __post_init__(self) -> None:
        if self.full <= 0 or self.small <= 0:
            raise ValueError(f"threads must be positive, got full={self.full}, small={self.small}")

    def for_step(self, num_tokens: int) -> int:
        return self.small if num_tokens <= self.small_tokens else self.full

    @classmethod
    def resolve(cls, threads: int, decode_threads: int | None) -> "StepThreads":
        """`threads` as set_num_threads chose them; decode_threads None: every thread for small
        steps too."""
        return cls(full=threads, small=min(threads, decode_threads or threads))


def memory_for_share(device: torch.device, weights: int) -> int:
    """What --gpu-memory-utilization is a share of, read with the weights already loaded: a GPU's
    whole memory (vLLM's meaning); on CPU the memory there was before the weights."""
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return total
    return available_memory_bytes(device) + weights


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
