"""Chained hash of full KV blocks: the same value on every process and machine.

hash(block i) = sha256(hash(block i-1) || token ids of block i as little-endian int64).
Python's built-in `hash` is salted per process, so it is never used here: prefill
workers, decode workers and routers must agree on every block's hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""32-byte sha256 digest identifying a full block and everything before it."""

ROOT_HASH: BlockHash = hashlib.sha256(b"pdserve:kv-block:v1").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(parent + payload).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
