"""CUDA kernels (cupy) for the GPU path, each with a torch reference in reference.py.

    store_kv                 new tokens' K/V into their cache slots        store_kv.cu
    paged_decode_attention   decode attention over block tables, split-K   paged_attention.cu
    pack_blocks/unpack_blocks  one request's blocks <-> a transfer payload  pack_blocks.cu
    block_checksum(_blocks)  per-block uint32 sums to verify a transfer    block_checksum.cu

Importing this package loads neither cupy nor CUDA; the first launch compiles the kernel's
file (loader.py). Arguments are checked on the host first (ValueError).
"""

from engine.kernels.blocks import (
    block_checksum,
    block_checksum_blocks,
    pack_blocks,
    store_kv,
    unpack_blocks,
)
from engine.kernels.paged_attention import paged_decode_attention

__all__ = [
    "block_checksum",
    "block_checksum_blocks",
    "pack_blocks",
    "paged_decode_attention",
    "store_kv",
    "unpack_blocks",
]
