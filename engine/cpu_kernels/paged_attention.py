"""Paged decode attention on the CPU (paged_decode.c): one query token per sequence over its
paged K/V, read in place from the cache blocks, in float32 or bfloat16.

The torch path it replaces (engine.model.attention._decode_group) first copies every block of
the context into one tensor and then runs SDPA over the copy. benchmarks/cpu_attention.py runs
both side by side: on this project's 2-core EPYC (AVX2), one thread, bfloat16, SmolLM2's shape,
one layer over a 2k-token context read from memory took 354 us against 767 (benchmarks/RESULTS.md,
2026-11-29; `--baseline REV` adds the kernel of another revision to the same run).
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
_ROPE_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_float]


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
        self._rope_bf16 = loaded.library.paged_decode_rope_bf16
        self._rope_bf16.argtypes = _ROPE_ARGTYPES
        self._rope_bf16.restype = ctypes.c_int
        self.unchecked_rope_decode = self._rope_bf16
        """paged_decode_rope_bf16 itself, rope_decode's call by address (the argument order there):
        for a caller that checked every shape once and calls it many times (engine.model.decode_plan)."""

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


    def rope_decode(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                    meta, num_heads: int, scale: float) -> torch.Tensor:
        """A step of decodes only, in bfloat16, one call: each token's q and k heads rotated as
        engine.model.rope.StepRope.apply does (x * cos + roll(x, half) * signed_sin, rounded as
        torch rounds it), k and v stored into meta.slot_mapping's slots, then __call__'s attention.

        qkv: [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim] (q, k, v heads); cos and
        signed_sin: the step's [num_seqs, 1, head_dim] rope factors; meta: the step's
        AttentionMetadata, one decode group whose tables and slots the runner checked. Returns
        [num_seqs, num_heads, head_dim]. Raises ValueError for arguments of other shapes or dtypes."""
        group = meta.decodes[0]
        _two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_seqs = qkv.shape[0]
        width = (num_heads + 2 * num_kv_heads) * head_dim
        for name, t in (("qkv", qkv), ("cos", cos), ("signed_sin", signed_sin), ("kv_cache", kv_cache)):
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor")
        if (qkv.shape != (num_seqs, width) or cos.numel() != num_seqs * head_dim
                or signed_sin.numel() != num_seqs * head_dim or group.block_tables.shape[0] != num_seqs
                or meta.slot_mapping.shape != (num_seqs,)):
            raise ValueError(f"qkv {tuple(qkv.shape)}, rope {tuple(cos.shape)} and {num_seqs} slots do not fit "
                             f"{num_heads} query heads over the cache {tuple(kv_cache.shape)}")
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.bfloat16)
        rc = self._rope_bf16(
            qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), meta.slot_mapping.data_ptr(), kv_cache.data_ptr(),
            out.data_ptr(), group.block_tables.data_ptr(), group.context_lens.data_ptr(), num_seqs,
            group.block_tables.shape[1], num_blocks, block_size, num_kv_heads, num_heads // num_kv_heads, head_dim,
            scale)
        if rc != 0:
            raise MemoryError(f"the CPU decode kernel could not allocate its buffers ({num_seqs} sequences)")
        return out


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError unless every slot lies in [0, num_slots) (the kernel writes K/V there)."""
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 vector")
    if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_slots):
        raise ValueError(f"slots must lie in [0, {num_slots}): got {int(slot_mapping.min())}.."
                         f"{int(slot_mapping.max())}")


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
