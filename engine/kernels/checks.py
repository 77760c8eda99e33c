"""Argument checks shared by the kernel wrappers. Pure torch: they run (and are tested) on
CPU, before any CUDA or cupy is touched. Each raises ValueError saying what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kernels.loader import DTYPE_SUFFIX


def cache_shape(kv_cache: torch.Tensor, name: str = "kv_cache") -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of a contiguous layer cache."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name} must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    contiguous(kv_cache, name)
    _, num_blocks, block_size, heads, head_dim = kv_cache.shape
    return num_blocks, block_size, heads, head_dim


def contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")


def typed(t: torch.Tensor, name: str) -> str:
    """The kernel-name suffix of t's dtype."""
    if t.dtype not in DTYPE_SUFFIX:
        known = ", ".join(str(d) for d in DTYPE_SUFFIX)
        raise ValueError(f"{name} has dtype {t.dtype}; the kernels take {known}")
    return DTYPE_SUFFIX[t.dtype]


def same_dtype(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")


def index_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {dtype} of shape {shape}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    contiguous(t, name)


def on_cuda(*tensors: torch.Tensor) -> torch.device:
    """The one CUDA device all tensors are on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"the kernels take tensors on one CUDA device, got "
                         f"{sorted(str(d) for d in devices)}; use the torch path on CPU")
    return next(iter(devices))


def layer_caches(kv_caches: Sequence[torch.Tensor]) -> tuple[int, int, int, int]:
    """cache_shape of layer 0, after checking every layer has its shape, dtype and device."""
    if not kv_caches:
        raise ValueError("no KV caches given")
    shape = cache_shape(kv_caches[0], "kv_caches[0]")
    first = kv_caches[0]
    for layer, cache in enumerate(kv_caches):
        contiguous(cache, f"kv_caches[{layer}]")
        if (cache.shape, cache.dtype, cache.device) != (first.shape, first.dtype, first.device):
            raise ValueError(f"layer {layer} cache {tuple(cache.shape)} {cache.dtype} "
                             f"{cache.device} differs from layer 0 {tuple(first.shape)} "
                             f"{first.dtype} {first.device}")
    return shape


def block_ids(ids: Sequence[int], num_blocks: int) -> list[int]:
    """ids as ints, each in [0, num_blocks), none repeated."""
    out = [int(b) for b in ids]
    bad = [b for b in out if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} out of range for {num_blocks} blocks")
    if len(set(out)) != len(out):
        raise ValueError(f"block ids repeat: {out}")
    return out


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address as the 8-byte kernel argument cupy needs."""
    return np.uint64(t.data_ptr())
