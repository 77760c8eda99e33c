"""Torch reference of each CUDA kernel: plain, slow, obviously right, and runnable on CPU.

The GPU tests compare every kernel against these; the CPU tests check these against dense
attention and round trips. Layouts as in the kernels: a layer's cache is [2, num_blocks,
block_size, num_kv_heads, head_dim] (K then V); a payload is [num_layers, 2, n, block_size,
num_kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def store_kv_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping, in place;
    slots < 0 are skipped. Raises IndexError on a slot past the cache."""
    flat = _raw(kv_cache).view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    flat[0][slots] = _raw(key.to(kv_cache.dtype))[keep]
    flat[1][slots] = _raw(value.to(kv_cache.dtype))[keep]


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim] in q's dtype.

    Sequence s attends over its first context_lens[s] tokens (clamped to [0, the block
    table's width x block_size]); token p is in block block_tables[s, p // block_size] at
    offset p % block_size. Query head h reads kv head h // (num_heads // num_kv_heads).
    Computed in float64; a sequence with context 0 gets zeros.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    k_all = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    v_all = kv_cache[1].reshape(-1, num_kv_heads, head_dim)
    max_context = block_tables.shape[1] * block_size
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        ctx = min(max(int(context_lens[s]), 0), max_context)
        if ctx == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[s, pos // block_size].to(torch.int64) * block_size + pos % block_size
        k = k_all[slots].double().repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = v_all[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s].double(), k) * scale
        out[s] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def pack_blocks_ref(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """A new payload holding block_ids of every layer, in order."""
    ids = torch.tensor([int(b) for b in block_ids], dtype=torch.int64,
                       device=kv_caches[0].device)
    return torch.stack([_raw(cache)[:, ids] for cache in kv_caches]).view(kv_caches[0].dtype)


def unpack_blocks_ref(payload: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                      block_ids: Sequence[int]) -> None:
    """Write payload into block_ids of every layer, in place."""
    ids = torch.tensor([int(b) for b in block_ids], dtype=torch.int64,
                       device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        _raw(cache)[:, ids] = _raw(payload[layer])


def block_checksum_ref(payload: torch.Tensor) -> torch.Tensor:
    """int64 [num_layers, 2, n]: each block's bytes as little-endian uint32 words, summed
    mod 2^32. Raises ValueError when a block is not a whole number of words."""
    layers, _, n = payload.shape[:3]
    block_bytes = payload[0, 0, 0].numel() * payload.element_size() if n else 0
    if block_bytes % 4:
        raise ValueError(f"a block of {block_bytes} bytes is not a whole number of uint32 words")
    raw = payload.contiguous().view(torch.uint8).reshape(layers, 2, n, block_bytes)
    words = raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return words.sum(dim=-1) & 0xFFFFFFFF


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8: torch's index kernels do not take float8."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t
