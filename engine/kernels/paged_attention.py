"""Paged decode attention on CUDA (paged_attention.cu): one query token per sequence over its
paged K/V, split over the context ("flash-decoding") when that fills the device better.

`plan` is pure arithmetic (tested on CPU); `paged_decode_attention` checks its arguments,
then enqueues one or two kernels on torch's current stream and returns without waiting.
The torch reference is reference.paged_decode_attention_ref.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels import checks
from engine.kernels.loader import launch, sm_count

MAX_HEAD_DIM = 256  # 32 lanes x PA_MAX_PER_LANE in paged_attention.cu
SHARED_MEM_LIMIT = 48 * 1024  # what a launch gets without opting in to more
DEFAULT_PARTITION = 512  # tokens per partition
MIN_SPLIT_PARTITION = 128  # smallest partition chosen only to fill the device
MAX_GRID_YZ = 65535
REDUCE_THREADS = 128
_SOURCE = "paged_attention.cu"


@dataclass(frozen=True)
class AttentionPlan:
    """How one call is cut up: partition_size tokens per CTA, num_partitions CTAs along the
    context (1: no reduce kernel), threads per CTA and dynamic shared memory in bytes."""

    partition_size: int
    num_partitions: int
    threads: int
    shared_mem: int


def shared_mem_bytes(group: int, head_dim: int, partition_size: int) -> int:
    """The partition kernel's dynamic shared memory (layout: paged_attention.cu's header)."""
    return partition_size * 8 + group * head_dim * 4 + group * partition_size * 4 + group * 8


def plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_context: int,
         num_sms: int) -> AttentionPlan:
    """Partitions of DEFAULT_PARTITION tokens, halved while the shared memory does not fit,
    and halved down to MIN_SPLIT_PARTITION while the grid has fewer than 2 CTAs per SM.
    Raises ValueError when even 32-token partitions do not fit the shared memory."""
    group = num_heads // num_kv_heads
    size = DEFAULT_PARTITION
    while size > 32 and shared_mem_bytes(group, head_dim, size) > SHARED_MEM_LIMIT:
        size //= 2
    if shared_mem_bytes(group, head_dim, size) > SHARED_MEM_LIMIT:
        raise ValueError(f"{group} query heads per kv head with head_dim {head_dim} do not fit "
                         f"the kernel's {SHARED_MEM_LIMIT} bytes of shared memory")

    def ctas(s: int) -> int:
        return num_seqs * num_kv_heads * -(-max_context // s)

    while size > MIN_SPLIT_PARTITION and ctas(size) < 2 * num_sms:
        size //= 2
    threads = 128 if group * head_dim <= 128 else 256
    return AttentionPlan(size, max(1, -(-max_context // size)), threads,
                         shared_mem_bytes(group, head_dim, size))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each sequence's one query over its first context_lens[s] cached tokens.

    q: [num_seqs, num_heads, head_dim]; kv_cache: one layer [2, num_blocks, block_size,
    num_kv_heads, head_dim] of q's dtype (float32, float16 or bfloat16); block_tables:
    int32 [num_seqs, max_blocks_per_seq]; context_lens: int32 [num_seqs] (clamped to
    [0, max_blocks_per_seq * block_size]; 0 gives zeros). All contiguous, on one CUDA device.
    Returns `out` (allocated when None), [num_seqs, num_heads, head_dim], every element
    written. Mutates only `out`; does not wait for the kernels. Block ids must be valid
    (< num_blocks): they are read on the device and not checked. Raises ValueError on any
    other bad argument, RuntimeError when cupy is missing.
    """
    suffix = checks.typed(q, "q")
    num_blocks, block_size, num_kv_heads, head_dim = checks.cache_shape(kv_cache)
    checks.same_dtype(kv_cache, "kv_cache", q.dtype)
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [num_seqs, num_heads, {head_dim}], got {tuple(q.shape)}")
    checks.contiguous(q, "q")
    num_seqs, num_heads, _ = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM}, the kernel's limit")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be 2-D, got {tuple(block_tables.shape)}")
    max_blocks = block_tables.shape[1]
    checks.index_tensor(block_tables, "block_tables", torch.int32, (num_seqs, max_blocks))
    checks.index_tensor(context_lens, "context_lens", torch.int32, (num_seqs,))
    if num_seqs > MAX_GRID_YZ:
        raise ValueError(f"{num_seqs} sequences > {MAX_GRID_YZ}; split the batch")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {q.dtype} {tuple(q.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    device = checks.on_cuda(q, kv_cache, block_tables, context_lens, out)
    if num_seqs == 0:
        return out
    max_context = max_blocks * block_size
    p = plan(num_seqs, num_heads, num_kv_heads, head_dim, max_context, sm_count(device.index))
    if p.num_partitions > MAX_GRID_YZ:
        raise ValueError(f"context {max_context} needs {p.num_partitions} partitions > "
                         f"{MAX_GRID_YZ}")
    i32 = np.int32
    if p.num_partitions == 1:
        part_out = part_max = part_sum = None
    else:
        part_out = torch.empty((num_seqs, num_heads, p.num_partitions, head_dim),
                               dtype=torch.float32, device=device)
        part_max = torch.empty((num_seqs, num_heads, p.num_partitions), dtype=torch.float32,
                               device=device)
        part_sum = torch.empty_like(part_max)
    parts = tuple(np.uint64(0) if t is None else checks.ptr(t)
                  for t in (part_out, part_max, part_sum))
    launch(_SOURCE, f"paged_attention_partition_{suffix}", device,
           (num_kv_heads, num_seqs, p.num_partitions), (p.threads, 1, 1),
           (checks.ptr(out), *parts, checks.ptr(q), checks.ptr(kv_cache),
            checks.ptr(block_tables), checks.ptr(context_lens), np.float32(scale),
            i32(num_heads), i32(num_kv_heads), i32(head_dim), i32(block_size),
            np.int64(num_blocks), i32(max_blocks), i32(p.partition_size),
            i32(p.num_partitions)),
           shared_mem=p.shared_mem)
    if p.num_partitions > 1:
        launch(_SOURCE, f"paged_attention_reduce_{suffix}", device, (num_heads, num_seqs, 1),
               (REDUCE_THREADS, 1, 1),
               (checks.ptr(out), *parts, checks.ptr(context_lens), i32(num_heads),
                i32(head_dim), i32(max_context), i32(p.partition_size), i32(p.num_partitions)))
    return out
