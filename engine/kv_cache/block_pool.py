"""Block pool: reference counts, an LRU free queue, and the prefix-cache index.

No device code: a block is an id into the per-layer KV tensors the runner owns.

A block is in exactly one of three states:
  in use    ref_cnt > 0, not in the free queue;
  cached    ref_cnt == 0, in the free queue, still findable by its hash;
  free      ref_cnt == 0, in the free queue, no hash.
Allocation takes blocks from the head of the free queue (least recently freed first),
evicting a cached block's hash when it is reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from engine.kv_cache.hashing import BlockHash


class Block:
    """One KV block's bookkeeping. `prev`/`next` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt 0: O(1) pop from the head, O(1) removal."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)  # sentinels keep the link code branch-free
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next
        assert block is not self._tail and block is not None, "popleft on an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not in the queue"
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None, f"{block} is already in the queue"
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.size += 1

    def __iter__(self):
        block = self._head.next
        while block is not self._tail and block is not None:
            yield block
            block = block.next


@dataclass(frozen=True)
class BlockEvents:
    """Hashes that became findable (stored) or stopped being findable (evicted)."""

    stored: tuple[BlockHash, ...]
    evicted: tuple[BlockHash, ...]


class BlockPool:
    """Owns every block of one KV cache. Not thread-safe: one engine loop drives it."""

    MAX_PENDING_EVENTS = 100_000
    """Events kept until taken. A worker takes them every loop iteration; an offline engine
    never does, so past this bound the oldest pending ones are dropped (memory stays flat)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self._stored: list[BlockHash] = []
        self._evicted: list[BlockHash] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free or cached-but-unused)."""
        return self.free_queue.size

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests, 0.0..1.0."""
        return 1.0 - self.free_queue.size / self.num_blocks

    def get_new_blocks(self, count: int) -> list[Block] | None:
        """Take `count` blocks with ref_cnt 1, or None (nothing taken) when too few are free.

        Which blocks: the free queue's first `count` (the eviction order). Their order: by id.
        A finished request's blocks come back last-first, so taken in queue order a new table
        would run backwards through memory; the decode kernel reads a table front to back and
        reads neighbours in ascending order fastest (a 2k-token context on the CPU: 161 us a
        layer ascending, 205 descending, 253 scattered; benchmarks/cpu_attention.py)."""
        if count > self.free_queue.size:
            return None
        taken = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        if count > 1:
            taken.sort(key=attrgetter("block_id"))
        return taken

    def lookup(self, block_hash: BlockHash) -> Block | None:
        """The cached block with this hash, or None. Does not change reference counts."""
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block (a prefix-cache hit), taking it off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the queue's tail in
        the order given (callers pass a request's blocks last-first, so a prefix's tail is
        evicted before its head)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already findable; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._stored.append(block_hash)
        self._bound_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_queue.size != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash findable now, in no particular order. Does not touch the events."""
        return list(self._cached)

    def take_events(self) -> BlockEvents:
        """Block events since the last call (for the cluster's prefix index)."""
        events = BlockEvents(tuple(self._stored), tuple(self._evicted))
        self._stored.clear()
        self._evicted.clear()
        return events

    def _bound_events(self) -> None:
        # Trimmed only at twice the bound, so dropping stays amortized O(1) per event.
        for events in (self._stored, self._evicted):
            if len(events) >= 2 * self.MAX_PENDING_EVENTS:
                del events[: len(events) - self.MAX_PENDING_EVENTS]

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self._evicted.append(block.block_hash)
            self._bound_events()
        block.block_hash = None
