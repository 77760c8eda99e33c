"""Pack one request's KV blocks into a contiguous payload, and write a payload back in place.

Cache layout (per layer): [2, num_blocks, block_size, num_kv_heads, head_dim], K then V.
Payload layout: [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim].
fp8 caches are indexed through uint8 views: CPU index kernels do not take float8.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.base import DTypeCode, TransferHeader

TORCH_DTYPES: dict[DTypeCode, torch.dtype] = {
    DTypeCode.FLOAT32: torch.float32,
    DTypeCode.BFLOAT16: torch.bfloat16,
    DTypeCode.FLOAT16: torch.float16,
    DTypeCode.FLOAT8_E4M3FN: torch.float8_e4m3fn,
}
DTYPE_CODES: dict[torch.dtype, DTypeCode] = {v: k for k, v in TORCH_DTYPES.items()}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_code(dtype: torch.dtype) -> DTypeCode:
    """Raises ValueError for a dtype the wire format does not carry."""
    if dtype not in DTYPE_CODES:
        known = ", ".join(str(d) for d in DTYPE_CODES)
        raise ValueError(f"no transfer dtype code for {dtype}; known: {known}")
    return DTYPE_CODES[dtype]


def make_header(ticket_id: int, first_token_id: int, payload: torch.Tensor,
                first_token_at: float | None = None) -> TransferHeader:
    """The header describing `payload` (shape as pack_blocks returns it). first_token_at:
    unix time (s) the first token was sampled, carried in microseconds; None: unknown."""
    if payload.dim() != 6 or payload.shape[1] != 2:
        raise ValueError(f"payload must be [layers, 2, blocks, block, heads, dim], got "
                         f"{tuple(payload.shape)}")
    layers, _, blocks, block_size, heads, head_dim = payload.shape
    at_us = round(first_token_at * 1e6) if first_token_at else 0
    return TransferHeader(ticket_id, first_token_id, layers, blocks, block_size, heads,
                          head_dim, dtype_code(payload.dtype), at_us)


def empty_payload(header: TransferHeader, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised payload of the header's shape and dtype (what a receiver fills)."""
    return torch.empty(header.payload_shape, dtype=TORCH_DTYPES[header.dtype], device=device)


def check_payload(header: TransferHeader, payload: torch.Tensor) -> None:
    """Raises ValueError unless payload is contiguous and of the header's shape and dtype."""
    dtype = TORCH_DTYPES[header.dtype]
    if tuple(payload.shape) != header.payload_shape or payload.dtype != dtype:
        raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not match its "
                         f"header {header.payload_shape} {dtype}")
    if not payload.is_contiguous():
        raise ValueError("payload must be contiguous")


def pack_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """Copy `block_ids` of every layer into one new contiguous payload.

    Does not mutate the caches; once it returns, the blocks may be freed and reused.
    Raises ValueError on mismatched layers or block ids out of range or repeated.
    """
    shape, dtype = _check_caches(kv_caches)
    index = _index(block_ids, shape[1], kv_caches[0].device)
    out = torch.empty((len(kv_caches), 2, len(block_ids), *shape[2:]), dtype=dtype,
                      device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        torch.index_select(_raw(cache), 1, index, out=_raw(out[layer]))
    return out


def block_index(block_ids: Sequence[int], kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The index tensor pack_layer and unpack_layer take (checked once per transfer, not once
    per layer).
    Raises ValueError on block ids out of range or repeated."""
    shape, _ = _check_caches(kv_caches)
    return _index(block_ids, shape[1], kv_caches[0].device)


def pack_layer(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One layer's share of pack_blocks: a new contiguous [2, len(index), block, heads, dim]
    copy of the indexed blocks (what a layer feed carries). Does not mutate `cache`."""
    out = torch.empty((2, len(index), *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
    torch.index_select(_raw(cache), 1, index, out=_raw(out))
    return out


def unpack_layer(layer_kv: torch.Tensor, cache: torch.Tensor, index: torch.Tensor) -> None:
    """One layer's share of unpack_blocks: write `layer_kv` ([2, len(index), block, heads, dim],
    as a layer feed carries it) into `cache` at the blocks of `index` (from block_index), in
    place. Raises ValueError when shape or dtype do not fit."""
    expected = (2, len(index), *cache.shape[2:])
    if tuple(layer_kv.shape) != expected or layer_kv.dtype != cache.dtype:
        raise ValueError(f"layer payload {tuple(layer_kv.shape)} {layer_kv.dtype} does not fit a cache "
                         f"needing {expected} {cache.dtype}")
    _raw(cache).index_copy_(1, index, _raw(layer_kv.to(cache.device)))


def unpack_blocks(payload: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int]) -> None:
    """Write `payload` (as pack_blocks made it) into `block_ids` of every layer, in place.

    Mutates the caches only at `block_ids`; does not keep `payload`. Raises ValueError when
    shapes, dtypes or block ids do not fit.
    """
    shape, dtype = _check_caches(kv_caches)
    expected = (len(kv_caches), 2, len(block_ids), *shape[2:])
    if tuple(payload.shape) != expected or payload.dtype != dtype:
        raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not fit caches "
                         f"needing {expected} {dtype}")
    index = _index(block_ids, shape[1], kv_caches[0].device)
    payload = payload.to(kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        _raw(cache).index_copy_(1, index, _raw(payload[layer]))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
    if not kv_caches:
        raise ValueError("no KV caches given")
    shape, dtype = tuple(kv_caches[0].shape), kv_caches[0].dtype
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"a layer's cache must be [2, blocks, block, heads, dim], got {shape}")
    for layer, cache in enumerate(kv_caches):
        if tuple(cache.shape) != shape or cache.dtype != dtype:
            raise ValueError(f"layer {layer} cache {tuple(cache.shape)} {cache.dtype} differs "
                             f"from layer 0 {shape} {dtype}")
    return shape, dtype


def _index(block_ids: Sequence[int], num_blocks: int, device: torch.device) -> torch.Tensor:
    ids = [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} out of range for {num_blocks} blocks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"block ids repeat: {ids}")
    return torch.tensor(ids, dtype=torch.int64, device=device)
