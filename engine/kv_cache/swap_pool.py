"""Swap pool: host-memory blocks that hold swapped-out requests' KV (pure bookkeeping).

No device code: a swap block is an id into the per-layer host tensors the runner owns
([2, num_swap_blocks, block_size, num_kv_heads, head_dim], the device cache's layout).
Swap blocks are never in the prefix cache: a swapped-out request's KV is private to it
until it is copied back into device blocks.
"""

from __future__ import annotations

from collections import deque


class SwapPool:
    """Which request holds which swap blocks. Not thread-safe: one engine loop drives it.

    A pool of 0 blocks is valid (swapping disabled): every `allocate` of one or more
    blocks returns None.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must not be negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, tuple[int, ...]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, request_id: str, count: int) -> tuple[int, ...] | None:
        """Take `count` swap blocks for the request from the head of the free queue;
        None (nothing taken) when fewer are free or count is not positive. Raises
        ValueError when the request already holds swap blocks (one swap-out at a time)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds swap blocks {self._tables[request_id]}")
        if count <= 0 or count > len(self._free):
            return None
        taken = tuple(self._free.popleft() for _ in range(count))
        self._tables[request_id] = taken
        return taken

    def blocks_of(self, request_id: str) -> tuple[int, ...]:
        """The request's swap blocks in table order; () when it holds none."""
        return self._tables.get(request_id, ())

    def free(self, request_id: str) -> tuple[int, ...]:
        """Release the request's swap blocks (idempotent); returns them, in table order.
        Freed blocks go to the back of the free queue."""
        blocks = self._tables.pop(request_id, ())
        self._free.extend(blocks)
        return blocks


def swap_blocks_for(swap_space_gib: float, bytes_per_block: int) -> int:
    """Whole blocks of `bytes_per_block` that `swap_space_gib` GiB of host memory holds."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return int(swap_space_gib * (1 << 30)) // bytes_per_block
