"""KV cache manager: which blocks each request holds, prefix-cache hits, allocation.

Running out of blocks is a return value (`None`), never an exception: the scheduler
decides whether to wait or preempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import Block, BlockEvents, BlockPool
from engine.kv_cache.hashing import ROOT_HASH, BlockHash, hash_block
from engine.request import Request


@dataclass(frozen=True)
class KVBlocks:
    """Block ids, in order, seen from outside the manager."""

    block_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class PrefixHit:
    """Blocks found in the prefix cache for a request, and the tokens they cover."""

    blocks: tuple[Block, ...]
    num_tokens: int


NO_HIT = PrefixHit((), 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over one BlockPool.

    A request's table covers its first `num_computed_tokens + num_new_tokens` tokens.
    Full blocks get their hash registered once their K/V are computed (`cache_computed`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_of(self, request_id: str) -> KVBlocks:
        return KVBlocks(tuple(b.block_id for b in self._tables.get(request_id, ())))

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks matching the request's tokens.

        At least one token is always left to compute, so the model produces logits.
        Read-only: takes no references (see `allocate`).
        """
        if not self.pool.enable_caching:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in self._block_hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> KVBlocks | None:
        """Grow the request's table to hold `num_computed_tokens + hit + num_new_tokens`.

        Mutates the pool and the table only on success; returns the blocks newly added
        (hit blocks included), or None when the pool cannot supply them.
        """
        table = self._tables.get(request.request_id, [])
        needed_tokens = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_new_blocks = cdiv(needed_tokens, self.block_size) - len(table) - len(hit.blocks)
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        num_hit_free = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_hit_free:
            return None
        self.pool.touch(hit.blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0)) or []
        added = [*hit.blocks, *new_blocks]
        table = self._tables.setdefault(request.request_id, table)
        table.extend(added)
        if hit.blocks:
            self._hashes[request.request_id] = [b.block_hash for b in hit.blocks]  # type: ignore[misc]
        return KVBlocks(tuple(b.block_id for b in added))

    def cache_computed(self, request: Request) -> None:
        """Register hashes of the request's full blocks whose K/V are now computed."""
        if not self.pool.enable_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        block_hashes = self._block_hashes(request, num_full)
        for i in range(len(hashes), num_full):
            hashes.append(block_hashes[i])
            self.pool.cache(table[i], block_hashes[i])

    def _block_hashes(self, request: Request, count: int) -> list[BlockHash]:
        """The request's block hashes, at least its first `count`, each computed once per
        request: schedule attempts, reservations and load reports ask again and again."""
        hashes = request.block_hashes
        if len(hashes) < count:
            tokens = request.all_token_ids
            bs = self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            for j in range(len(hashes), count):
                parent = hash_block(parent, tokens[j * bs : (j + 1) * bs])
                hashes.append(parent)
        return hashes

    def free(self, request_id: str) -> None:
        """Release every block of the request (idempotent): last block first, so under LRU
        the end of a prefix is evicted before its beginning."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self.pool.free(reversed(table))

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def take_events(self) -> BlockEvents:
        return self.pool.take_events()
