"""The router's prefix index: which worker holds which KV block, from the workers' block events.

Workers publish BlockEvents (stored, evicted, snapshot) to the cluster's Redis stream
(pdserve/kv_events.py); the router's reader (router/cluster/kv_event_reader.py) applies them here in
stream order. `match` then tells, for a prompt's chained block hashes, how many LEADING blocks
each worker holds — the prefix it would not have to recompute (or receive).

Incarnations fence stale entries. The index holds one incarnation per worker id. An event from
a different incarnation replaces it (the stream is in time order, so the later run wins) and
retires the old one; events of a retired incarnation are dropped from then on (a dying run's
late writes). `prune(snapshot)` aligns the index with the heartbeats: a worker absent from the
snapshot for absent_grace_s is dropped, and one whose heartbeat shows an incarnation the index
has not retired replaces the index's (older) entries.

Memory is bounded: at most max_workers workers, at most max_blocks_per_worker hashes each (the
oldest stored are forgotten first beyond that, which only happens when events were lost).

Pure: no redis, grpc or torch; a test checks it. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from engine.kv_cache.hashing import ROOT_HASH, BlockHash, hash_block, hash_full_blocks
from router.cluster.keys import ClusterSnapshot
from router.routing.policy import RouteRequest

__all__ = [
    "EVENT_KINDS",
    "HASH_BYTES",
    "BlockEvent",
    "EventKind",
    "PrefixIndex",
    "PromptHashes",
    "route_request",
]

EventKind = Literal["stored", "evicted", "snapshot"]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
HASH_BYTES = 32
"""Length of one block hash (a sha256 digest)."""
_RETIRED_PER_WORKER = 4


@dataclass(frozen=True)
class BlockEvent:
    """One stream entry: a worker's blocks that became findable (stored), stopped being
    findable (evicted), or all its findable blocks now (snapshot: replaces what it held)."""

    worker_id: str
    incarnation: str
    """The publishing process's run; fences events of a previous run of worker_id."""
    kind: EventKind
    hashes: tuple[BlockHash, ...]
    """32-byte chained block hashes (engine/kv_cache/hashing.py), in the worker's order."""

    def __post_init__(self) -> None:
        if not self.worker_id or not self.incarnation:
            raise ValueError("block event needs a worker_id and an incarnation")
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(EVENT_KINDS)}; got {self.kind!r}")
        bad = [h for h in self.hashes if not isinstance(h, bytes) or len(h) != HASH_BYTES]
        if bad:
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes; got {bad[0]!r}")

    def to_fields(self) -> dict[str, bytes]:
        """The stream entry's fields; `hashes` is the digests concatenated (binary)."""
        return {
            "worker_id": self.worker_id.encode(),
            "incarnation": self.incarnation.encode(),
            "kind": self.kind.encode(),
            "hashes": b"".join(self.hashes),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[bytes | str, bytes | str]) -> BlockEvent:
        """Parse an entry as XREAD returns it (bytes or str keys). Raises ValueError naming
        what is missing or malformed."""
        raw = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
        missing = [n for n in ("worker_id", "incarnation", "kind", "hashes") if n not in raw]
        if missing:
            raise ValueError(f"block event lacks field(s): {', '.join(missing)}")
        packed = raw["hashes"]
        if not isinstance(packed, bytes):
            raise ValueError("block event hashes must be bytes (read with decode_responses off)")
        if len(packed) % HASH_BYTES:
            raise ValueError(f"block event hashes are {len(packed)} bytes, not a multiple of 32")
        try:
            text = {n: _text(raw[n]) for n in ("worker_id", "incarnation", "kind")}
        except UnicodeDecodeError:
            raise ValueError("block event worker_id/incarnation/kind are not UTF-8") from None
        hashes = tuple(packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES))
        return cls(text["worker_id"], text["incarnation"], text["kind"], hashes)  # type: ignore[arg-type]


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


class _Worker:
    """What the index holds for one worker id: its run, its bit in the masks, its hashes."""

    __slots__ = ("absent_since", "bit", "hashes", "incarnation", "slot")

    def __init__(self, incarnation: str, slot: int) -> None:
        self.incarnation = incarnation
        self.slot = slot
        self.bit = 1 << slot
        # Insertion order = store order, so a full worker forgets its oldest hashes first.
        self.hashes: OrderedDict[BlockHash, None] = OrderedDict()
        self.absent_since: float | None = None


class PrefixIndex:
    """Block hash -> the workers holding it (a bit mask over worker slots), plus per worker
    its incarnation and hashes. Counters (`applied`, `fenced`, `rejected`, `truncated`) only
    grow."""

    def __init__(
        self,
        max_workers: int = 1024,
        max_blocks_per_worker: int = 1 << 20,
        absent_grace_s: float = 3.0,
    ) -> None:
        """absent_grace_s: how long (in snapshot.taken_at seconds) a worker may be missing
        from the heartbeats before prune drops it; covers a new worker whose events arrive
        before its first heartbeat, and heartbeats re-registering after Redis restarts."""
        if max_workers < 1 or max_blocks_per_worker < 1:
            raise ValueError("max_workers and max_blocks_per_worker must be >= 1")
        if absent_grace_s < 0:
            raise ValueError(f"absent_grace_s must be >= 0; got {absent_grace_s}")
        self.max_workers = max_workers
        self.max_blocks_per_worker = max_blocks_per_worker
        self.absent_grace_s = absent_grace_s
        self._holders: dict[BlockHash, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: dict[int, str] = {}
        self._free_slots = list(range(max_workers - 1, -1, -1))  # pop() hands out slot 0 first
        # Retired incarnations per worker id, kept after the worker is dropped (a late write
        # may still come); the dict is bounded like the workers.
        self._retired: OrderedDict[str, deque[str]] = OrderedDict()
        self.applied = 0
        """Events applied."""
        self.fenced = 0
        """Events dropped because their incarnation was retired."""
        self.rejected = 0
        """Events dropped because max_workers workers were already indexed."""
        self.truncated = 0
        """Hashes forgotten because a worker exceeded max_blocks_per_worker."""

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._holders)

    def workers(self) -> dict[str, str]:
        """worker_id -> the incarnation the index holds for it."""
        return {worker_id: w.incarnation for worker_id, w in self._workers.items()}

    def holdings(self) -> dict[str, tuple[str, int]]:
        """worker_id -> (the incarnation the index holds for it, how many hashes it holds)."""
        return {worker_id: (w.incarnation, len(w.hashes)) for worker_id, w in self._workers.items()}

    def blocks_of(self, worker_id: str) -> frozenset[BlockHash]:
        """The hashes the index holds for worker_id (empty when it holds none)."""
        worker = self._workers.get(worker_id)
        return frozenset(worker.hashes) if worker is not None else frozenset()

    def match(self, hashes: Iterable[BlockHash]) -> dict[str, int]:
        """worker_id -> how many leading blocks of `hashes` (a prompt's chained block
        hashes, in order) that worker holds; workers holding none are absent. Consumes the
        iterable only while some worker still matches, so it may be a lazy generator."""
        counts: dict[str, int] = {}
        alive = 0
        position = 0
        for position, block_hash in enumerate(hashes):
            mask = self._holders.get(block_hash, 0)
            still = mask if position == 0 else alive & mask
            self._record(alive & ~still, position, counts)
            alive = still
            if not alive:
                return counts
        self._record(alive, position + 1, counts)
        return counts

    def _record(self, mask: int, count: int, counts: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            counts[self._slot_owner[low.bit_length() - 1]] = count
            mask ^= low

    # ------------------------------------------------------------------ writing
    def apply(self, event: BlockEvent) -> bool:
        """Apply one event in stream order. Returns False (and counts why) when it is dropped:
        its incarnation was retired, or no worker slot is free."""
        if event.incarnation in self._retired.get(event.worker_id, ()):
            self.fenced += 1
            return False
        worker = self._workers.get(event.worker_id)
        if worker is not None and worker.incarnation != event.incarnation:
            self._replace_incarnation(event.worker_id, worker, event.incarnation)
        if worker is None:
            worker = self._add_worker(event.worker_id, event.incarnation)
            if worker is None:
                self.rejected += 1
                return False
        if event.kind == "snapshot":
            self._clear(worker)
        if event.kind == "evicted":
            self._evict(worker, event.hashes)
        else:
            self._store(worker, event.hashes)
        self.applied += 1
        return True

    def drop_worker(self, worker_id: str) -> int:
        """Forget everything the worker holds and free its slot; returns how many hashes it
        held. Its incarnation is NOT retired: after a Redis restart the same run comes back."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return 0
        held = len(worker.hashes)
        self._clear(worker)
        del self._slot_owner[worker.slot]
        self._free_slots.append(worker.slot)
        return held

    def prune(self, snapshot: ClusterSnapshot) -> tuple[str, ...]:
        """Align with the heartbeats; returns the worker ids dropped. A stale snapshot (Redis
        unreadable) proves nothing, so it changes nothing."""
        if snapshot.stale:
            return ()
        live = {w.worker_id: w.incarnation for w in snapshot.workers}
        dropped = []
        for worker_id, worker in list(self._workers.items()):
            incarnation = live.get(worker_id)
            if incarnation is None:
                if worker.absent_since is None:
                    worker.absent_since = snapshot.taken_at
                if snapshot.taken_at - worker.absent_since >= self.absent_grace_s:
                    self.drop_worker(worker_id)
                    dropped.append(worker_id)
                continue
            worker.absent_since = None
            retired = self._retired.get(worker_id, ())
            if incarnation != worker.incarnation and incarnation not in retired:
                # The heartbeat shows a run we have no events from yet: ours is older.
                self._replace_incarnation(worker_id, worker, incarnation)
        return tuple(dropped)

    def _add_worker(self, worker_id: str, incarnation: str) -> _Worker | None:
        if not self._free_slots:
            return None
        worker = _Worker(incarnation, self._free_slots.pop())
        self._workers[worker_id] = worker
        self._slot_owner[worker.slot] = worker_id
        return worker

    def _replace_incarnation(self, worker_id: str, worker: _Worker, incarnation: str) -> None:
        retired = self._retired.pop(worker_id, None) or deque(maxlen=_RETIRED_PER_WORKER)
        retired.append(worker.incarnation)
        self._retired[worker_id] = retired  # re-inserted last: most recently retired
        while len(self._retired) > self.max_workers:
            self._retired.popitem(last=False)
        self._clear(worker)
        worker.incarnation = incarnation

    def _store(self, worker: _Worker, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            if block_hash in worker.hashes:
                worker.hashes.move_to_end(block_hash)
                continue
            worker.hashes[block_hash] = None
            self._holders[block_hash] = self._holders.get(block_hash, 0) | worker.bit
            if len(worker.hashes) > self.max_blocks_per_worker:
                oldest, _ = worker.hashes.popitem(last=False)
                self._unset(oldest, worker.bit)
                self.truncated += 1

    def _evict(self, worker: _Worker, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            if block_hash in worker.hashes:
                del worker.hashes[block_hash]
                self._unset(block_hash, worker.bit)

    def _clear(self, worker: _Worker) -> None:
        for block_hash in worker.hashes:
            self._unset(block_hash, worker.bit)
        worker.hashes.clear()

    def _unset(self, block_hash: BlockHash, bit: int) -> None:
        mask = self._holders[block_hash] & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            del self._holders[block_hash]


class PromptHashes:
    """One prompt's chained block hashes per block size, each hashed at most once and only as
    far as read: the router reads them to route a request (match, which stops at the first
    block nobody holds) and again to note where it sent it (every full block). A 2,000-token
    prompt is ~0.2 ms of sha256 a pass."""

    __slots__ = ("token_ids", "_hashed")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._hashed: dict[int, list[BlockHash]] = {}

    def __len__(self) -> int:
        """Prompt tokens."""
        return len(self.token_ids)

    def lazily(self, block_size: int) -> Iterator[BlockHash]:
        """Every full block's hash in order, hashing only what a reader gets to."""
        hashed = self._hashed.setdefault(block_size, [])
        token_ids, i = self.token_ids, 0
        while True:
            if i == len(hashed):
                start = i * block_size
                if start + block_size > len(token_ids):
                    return
                hashed.append(hash_block(hashed[-1] if hashed else ROOT_HASH, token_ids[start : start + block_size]))
            yield hashed[i]
            i += 1

    def all(self, block_size: int) -> tuple[BlockHash, ...]:
        """Every full block's hash in order (the rest past what was read, in one go)."""
        hashed = self._hashed.setdefault(block_size, [])
        hashed += hash_full_blocks(self.token_ids[len(hashed) * block_size :], block_size,
                                   hashed[-1] if hashed else ROOT_HASH)
        return tuple(hashed)


def as_prompt_hashes(prompt: Sequence[int] | PromptHashes) -> PromptHashes:
    return prompt if isinstance(prompt, PromptHashes) else PromptHashes(prompt)


def route_request(
    prompt_token_ids: Sequence[int] | PromptHashes,
    max_tokens: int | None,
    snapshot: ClusterSnapshot,
    index: PrefixIndex,
) -> RouteRequest:
    """The RouteRequest for a prompt, with `cached_blocks` filled from the index: for each
    worker in the snapshot, the leading prompt blocks it holds, counted in its own block size
    (the prompt is hashed once per distinct block size; sizes never share hashes), and
    `held_blocks`: how many blocks of any prompt the index holds for each worker. Entries the
    index holds for another incarnation than the heartbeat's count as nothing. A PromptHashes
    keeps what it hashed for the next reader (note_routed)."""
    prompt = as_prompt_hashes(prompt_token_ids)
    holdings = index.holdings()
    current = {w.worker_id: w.incarnation for w in snapshot.workers}
    held = {worker_id: count for worker_id, (incarnation, count) in holdings.items()
            if count and current.get(worker_id) == incarnation}
    cached: dict[str, int] = {}
    for block_size in sorted({w.block_size for w in snapshot.workers}):
        matched = index.match(prompt.lazily(block_size))
        for w in snapshot.workers:
            count = matched.get(w.worker_id, 0)
            if w.block_size == block_size and count and w.worker_id in held:
                cached[w.worker_id] = count
    return RouteRequest(
        num_prompt_tokens=len(prompt),
        max_tokens=max_tokens,
        cached_blocks=tuple(sorted(cached.items())),
        held_blocks=tuple(sorted(held.items())),
    )
