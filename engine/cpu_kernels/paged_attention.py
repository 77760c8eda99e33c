"""Paged decode attention on the CPU (paged_decode.c): one query token per sequence over its
paged K/V, read in place from the cache blocks, in float32 or bfloat16.

The torch path it replaces (engine.model.attention._decode_group) first copies every block of
the context into one tensor and then runs SDPA over the copy. benchmarks/cpu_attention.py runs
both side by side: on this project's 2-core EPYC, one thread, bfloat16, SmolLM2's shape, one
layer over a 2k-token context read from memory took 296 us against 536 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes

import torch

from engine.cpu_kernels.loader import Loaded

LANES = 16
"""A row is handled as vectors of 16 floats, so head_dim must be a multiple of 16."""
MAX_HEAD_DIM = 256
MAX_GROUP = 16
"""Most query heads per kv head (paged_decode.c's MAX_GROUP)."""
MAX_HEADS = 1024
"""Most query heads (paged_decode.c's MAX_HEADS)."""

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]


def unsupported(dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                head_dim: int) -> str | None:
    """Why the kernel cannot serve this model and cache, or None when it can."""
    if dtype not in _SUFFIX:
        return f"dtype {dtype} (it takes float32 and bfloat16)"
    if kv_dtype != dtype:
        return f"KV cache dtype {kv_dtype} differs from the model's {dtype}"
    if head_dim % LANES or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} (it takes multiples of {LANES} up to {MAX_HEAD_DIM})"
    if num_kv_heads <= 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} kv heads (at most {MAX_GROUP} per kv head)"
    if num_heads > MAX_HEADS:
        return f"{num_heads} query heads (at most {MAX_HEADS})"
    return None


class PagedDecodeKernel:
    """The kernel of one loaded library; call it like the torch path (see __call__)."""

    def __init__(self, loaded: Loaded) -> None:
        if loaded.library is None:
            raise ValueError(f"no kernel library: {loaded.reason}")
        self.path = loaded.path
        self._functions = {}
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(loaded.library, f"paged_decode_{suffix}")
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
            self._functions[dtype] = fn

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of each sequence's one query over its first context_lens[s] cached tokens.

        q: [num_seqs, num_heads, head_dim]; kv_cache: one layer [2, num_blocks, block_size,
        num_kv_heads, head_dim] of q's dtype; block_tables: int64 [num_seqs, max_blocks];
        context_lens: int64 [num_seqs]. All contiguous CPU tensors. Returns a new
        [num_seqs, num_heads, head_dim] tensor of q's dtype. The tables' values are the
        caller's to check (check_tables, once per step: every layer reuses them): a block id
        outside the cache reads outside it. Raises ValueError on any other bad argument.
        """
        num_seqs, num_heads, head_dim = _shape(q, 3, "q")
        _two, num_blocks, block_size, num_kv_heads, cache_head_dim = _shape(kv_cache, 5, "kv_cache")
        if _two != 2 or cache_head_dim != head_dim or kv_cache.dtype != q.dtype:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not fit q "
                             f"{tuple(q.shape)} {q.dtype}")
        reason = unsupported(q.dtype, kv_cache.dtype, num_heads, num_kv_heads, head_dim)
        if reason:
            raise ValueError(f"the CPU decode kernel does not take {reason}")
        if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("block_tables and context_lens must be int64")
        if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or tuple(context_lens.shape) != (num_seqs,):
            raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                             f"{tuple(context_lens.shape)} do not fit {num_seqs} sequences")
        for name, t in (("q", q), ("kv_cache", kv_cache), ("block_tables", block_tables), ("context_lens", context_lens)):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous CPU tensor")
        out = torch.empty_like(q)
        rc = self._functions[q.dtype](
            q.data_ptr(), kv_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            num_seqs, block_tables.shape[1], num_blocks, block_size, num_kv_heads, num_heads // num_kv_heads,
            head_dim, scale)
        if rc != 0:
            raise MemoryError(f"the CPU decode kernel could not allocate its buffers (context up to "
                              f"{int(context_lens.max())} tokens)")
        return out


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ValueError unless every block id lies in [0, num_blocks) and every context fits its
    row of the table (0 <= context_lens[s] <= max_blocks * block_size)."""
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        raise ValueError(f"block ids must lie in [0, {num_blocks}): got {int(block_tables.min())}.."
                         f"{int(block_tables.max())}")
    limit = block_tables.shape[1] * block_size
    if context_lens.numel() and (int(context_lens.min()) < 0 or int(context_lens.max()) > limit):
        raise ValueError(f"context lengths must lie in [0, {limit}] ({block_tables.shape[1]} blocks of "
                         f"{block_size}): got {int(context_lens.min())}..{int(context_lens.max())}")


def _shape(t: torch.Tensor, dims: int, name: str) -> tuple[int, ...]:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got {tuple(t.shape)}")
    return tuple(t.shape)
