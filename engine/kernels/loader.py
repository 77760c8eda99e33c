"""Load the .cu files of this package with cupy, once each, and launch their kernels on
torch's current stream.

cupy is imported here lazily, on the first launch: importing engine.kernels needs neither
cupy nor CUDA, and the CPU path never loads it. Every kernel is `extern "C"`, one per dtype
(`_f32`, `_f16`, `_bf16` suffixes), so the module needs no `name_expressions` (those are
for C++ template instantiations) and each kernel is fetched by its plain name.
One CUDA device per process (the workers' model); cupy caches compiled modules per device
and on disk (~/.cupy/kernel_cache), so a process compiles each file at most once.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import cupy

KERNEL_DIR = Path(__file__).resolve().parent
COMPILE_OPTIONS = ("-std=c++17",)

# Every kernel a wrapper may launch, per source file; tests check each exists in its file.
KERNELS: dict[str, tuple[str, ...]] = {
    "store_kv.cu": ("store_kv_f32", "store_kv_f16", "store_kv_bf16"),
    "paged_attention.cu": (
        "paged_attention_partition_f32", "paged_attention_partition_f16",
        "paged_attention_partition_bf16", "paged_attention_reduce_f32",
        "paged_attention_reduce_f16", "paged_attention_reduce_bf16",
    ),
    "pack_blocks.cu": ("pack_blocks", "unpack_blocks"),
    "block_checksum.cu": ("block_checksum_payload", "block_checksum_blocks"),
}

# Kernel-name suffix of each element type the typed kernels take.
DTYPE_SUFFIX: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}


def import_cupy() -> Any:
    """The cupy module. Raises RuntimeError (not ImportError) naming the fix when missing."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(
            "the CUDA kernels need cupy (e.g. `pip install cupy-cuda12x`, matching the CUDA "
            "of your torch build); the CPU path runs without it") from e
    return cupy


@functools.cache
def module(filename: str) -> cupy.RawModule:
    """The compiled module of one .cu file of this package (compiled on first use)."""
    if filename not in KERNELS:
        raise KeyError(f"unknown kernel file {filename!r}; known: {', '.join(sorted(KERNELS))}")
    cp = import_cupy()
    return cp.RawModule(code=(KERNEL_DIR / filename).read_text(), options=COMPILE_OPTIONS)


@functools.cache
def function(filename: str, name: str) -> cupy.RawKernel:
    if name not in KERNELS.get(filename, ()):
        raise KeyError(f"kernel {name!r} is not declared for {filename!r} in KERNELS")
    return module(filename).get_function(name)


def launch(filename: str, name: str, device: torch.device, grid: tuple[int, int, int],
           block: tuple[int, int, int], args: tuple[Any, ...], shared_mem: int = 0) -> None:
    """Enqueue one kernel on torch's current stream of `device`; returns without waiting.

    `args` must already be fixed-width numpy scalars (np.uint64 for pointers, np.int32,
    np.int64, np.float32): cupy passes a Python int as a 64-bit integer whatever the
    kernel's parameter type is.
    """
    cp = import_cupy()
    kernel = function(filename, name)
    stream = torch.cuda.current_stream(device).cuda_stream
    with cp.cuda.Device(device.index), cp.cuda.ExternalStream(stream, device.index):
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
