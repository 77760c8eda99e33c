"""C kernels for the CPU path, built with the host's C compiler on first use (loader.py).

    paged decode attention   one query per sequence over its paged K/V    paged_decode.c
                             (and, for a step of decodes, the rope and the K/V store before it)
    RMSNorm                  bfloat16 rows, the residual add fused in       rms_norm.c

Each has the torch path it replaces as its reference (engine.model.attention). Without a C
compiler `load_decode_kernel` says why, and the engine keeps the torch path.
"""

from __future__ import annotations

from engine.cpu_kernels.loader import PAGED_DECODE, Loaded, load, load_kernel
from engine.cpu_kernels.paged_attention import PagedDecodeKernel, check_slots, check_tables, unsupported

__all__ = ["Loaded", "PagedDecodeKernel", "check_slots", "check_tables", "load", "load_decode_kernel", "unsupported"]


def load_decode_kernel() -> tuple[PagedDecodeKernel | None, str]:
    """(the kernel, "") or (None, why there is none)."""
    return load_kernel(PAGED_DECODE, PagedDecodeKernel)
