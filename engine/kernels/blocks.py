"""Block copies on CUDA: store new tokens' K/V into their slots (store_kv.cu), pack and unpack
one request's blocks of every layer for a transfer (pack_blocks.cu), and per-block checksums
to verify one (block_checksum.cu).

Each function checks its arguments (ValueError), enqueues its kernel on torch's current
stream and returns without waiting. Torch references: reference.py. Layouts as in
kv_transfer/packing.py: a layer's cache is [2, num_blocks, block_size, num_kv_heads,
head_dim]; a payload is [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.kernels import checks
from engine.kernels.loader import launch

COPY_THREADS = 256
STORE_THREADS = 128
MAX_GRID_X = 65535  # the kernels loop over their work (grid-stride) past this


def store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping
    (int64 [num_tokens], slot = block_id * block_size + offset). Slots < 0 (padding) are
    skipped; so are slots past the cache, which the device cannot report (the reference
    raises). Mutates kv_cache only. key/value rows may be strided: each token's
    [num_kv_heads, head_dim] must be contiguous, and key, value and cache share one dtype."""
    suffix = checks.typed(kv_cache, "kv_cache")
    num_blocks, block_size, heads, head_dim = checks.cache_shape(kv_cache)
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got {tuple(slot_mapping.shape)}")
    num_tokens = slot_mapping.shape[0]
    checks.index_tensor(slot_mapping, "slot_mapping", torch.int64, (num_tokens,))
    for name, t in (("key", key), ("value", value)):
        checks.same_dtype(t, name, kv_cache.dtype)
        if tuple(t.shape) != (num_tokens, heads, head_dim):
            raise ValueError(f"{name} must be [{num_tokens}, {heads}, {head_dim}], got "
                             f"{tuple(t.shape)}")
        if num_tokens and (t.stride(2) != 1 or t.stride(1) != head_dim):
            raise ValueError(f"each token's {name} row must be contiguous, strides {t.stride()}")
    device = checks.on_cuda(kv_cache, slot_mapping, key, value)
    if num_tokens == 0:
        return
    launch("store_kv.cu", f"store_kv_{suffix}", device, (min(num_tokens, MAX_GRID_X), 1, 1),
           (STORE_THREADS, 1, 1),
           (checks.ptr(kv_cache), checks.ptr(key), checks.ptr(value), checks.ptr(slot_mapping),
            np.int64(num_tokens), np.int64(num_blocks * block_size),
            np.int64(heads * head_dim), np.int64(key.stride(0)), np.int64(value.stride(0))))


def pack_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy block_ids of every layer into one contiguous payload (allocated when out is None).

    Does not mutate the caches. Any element type (the copy is bytewise). Raises ValueError
    on mismatched layers, block ids out of range or repeated, or a wrong `out`."""
    b = _blocks_args(kv_caches, block_ids)
    expected = (len(kv_caches), 2, len(b.ids), *kv_caches[0].shape[2:])
    if out is None:
        out = torch.empty(expected, dtype=kv_caches[0].dtype, device=b.device)
    else:
        _check_payload(out, expected, kv_caches[0].dtype, b.device, "out")
    if b.ids:
        launch("pack_blocks.cu", "pack_blocks", b.device, (b.grid, 1, 1), (COPY_THREADS, 1, 1),
               (checks.ptr(out), *b.args))
    return out


def unpack_blocks(payload: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int]) -> None:
    """Write payload (as pack_blocks made it) into block_ids of every layer, in place.

    Mutates the caches only at block_ids; does not keep payload (which must stay unchanged
    until the copy ran on the current stream). Raises ValueError when shapes, dtypes,
    devices or block ids do not fit."""
    b = _blocks_args(kv_caches, block_ids)
    expected = (len(kv_caches), 2, len(b.ids), *kv_caches[0].shape[2:])
    _check_payload(payload, expected, kv_caches[0].dtype, b.device, "payload")
    if b.ids:
        launch("pack_blocks.cu", "unpack_blocks", b.device, (b.grid, 1, 1),
               (COPY_THREADS, 1, 1), (checks.ptr(payload), *b.args))


def block_checksum(payload: torch.Tensor) -> torch.Tensor:
    """Checksum of each block of a payload [num_layers, 2, n, ...]: int64 [num_layers, 2, n]
    holding the uint32 sum (mod 2^32) of the block's bytes as little-endian uint32 words."""
    if payload.dim() != 6 or payload.shape[1] != 2:
        raise ValueError(f"payload must be [layers, 2, blocks, block, heads, dim], got "
                         f"{tuple(payload.shape)}")
    checks.contiguous(payload, "payload")
    block_bytes = _block_bytes(payload.shape[3:], payload.element_size())
    device = checks.on_cuda(payload)
    chunks = payload.shape[0] * 2 * payload.shape[2]
    sums = torch.empty(chunks, dtype=torch.int32, device=device)
    if chunks:
        launch("block_checksum.cu", "block_checksum_payload", device,
               (min(chunks, MAX_GRID_X), 1, 1), (COPY_THREADS, 1, 1),
               (checks.ptr(sums), checks.ptr(payload), np.int64(chunks), np.int64(block_bytes)))
    return _unsigned(sums).view(payload.shape[:3])


def block_checksum_blocks(kv_caches: Sequence[torch.Tensor],
                          block_ids: Sequence[int]) -> torch.Tensor:
    """block_checksum(pack_blocks(kv_caches, block_ids)), read straight from the caches."""
    b = _blocks_args(kv_caches, block_ids)
    _block_bytes(kv_caches[0].shape[2:], kv_caches[0].element_size())
    sums = torch.empty(len(kv_caches) * 2 * len(b.ids), dtype=torch.int32, device=b.device)
    if b.ids:
        launch("block_checksum.cu", "block_checksum_blocks", b.device, (b.grid, 1, 1),
               (COPY_THREADS, 1, 1), (checks.ptr(sums), *b.args))
    return _unsigned(sums).view(len(kv_caches), 2, len(b.ids))


class _BlockArgs(NamedTuple):
    ids: list[int]
    args: tuple  # the kernels' arguments after the payload/out pointer
    device: torch.device
    grid: int
    # Device tensors args points into: the caller holds them until its launch. Freed after
    # it, their memory is reused only by work ordered after the kernel on the same stream.
    keep: tuple[torch.Tensor, ...]


def _blocks_args(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> _BlockArgs:
    num_blocks, block_size, heads, head_dim = checks.layer_caches(kv_caches)
    ids = checks.block_ids(block_ids, num_blocks)
    device = checks.on_cuda(kv_caches[0])
    # Small host-to-device copies, ordered on the current stream before the kernel.
    layer_ptrs = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64,
                              device=device)
    id_tensor = torch.tensor(ids, dtype=torch.int64, device=device)
    block_bytes = block_size * heads * head_dim * kv_caches[0].element_size()
    args = (checks.ptr(layer_ptrs), checks.ptr(id_tensor), np.int32(len(ids)),
            np.int32(len(kv_caches)), np.int64(num_blocks), np.int64(block_bytes))
    grid = min(len(kv_caches) * 2 * len(ids), MAX_GRID_X)
    return _BlockArgs(ids, args, device, grid, (layer_ptrs, id_tensor))


def _check_payload(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} {t.device} does not fit caches "
                         f"needing {shape} {dtype} {device}")
    checks.contiguous(t, name)


def _block_bytes(block_shape: Sequence[int], element_size: int) -> int:
    block_bytes = int(np.prod(block_shape)) * element_size
    if block_bytes % 4:
        raise ValueError(f"a block of {block_bytes} bytes is not a whole number of uint32 "
                         "words; checksums need a multiple of 4")
    return block_bytes


def _unsigned(sums: torch.Tensor) -> torch.Tensor:
    return sums.to(torch.int64) & 0xFFFFFFFF
