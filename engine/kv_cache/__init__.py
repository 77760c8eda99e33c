"""Paged KV cache bookkeeping (pure: no device code)."""

from engine.kv_cache.block_pool import Block, BlockEvents, BlockPool
from engine.kv_cache.hashing import ROOT_HASH, BlockHash, hash_block, hash_full_blocks
from engine.kv_cache.manager import KVBlocks, KVCacheManager, PrefixHit
from engine.kv_cache.swap_pool import SwapPool

__all__ = [
    "Block", "BlockEvents", "BlockHash", "BlockPool", "KVBlocks", "KVCacheManager",
    "PrefixHit", "ROOT_HASH", "SwapPool", "hash_block", "hash_full_blocks",
]
