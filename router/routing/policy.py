"""Routing policies: which prefill worker and which decode worker serve a request (pure).

A policy is `choose(request, snapshot, rng) -> RouteDecision | None`: it reads only its
arguments, and returns None when the snapshot has no worker that can decode. Reading Redis,
counting decisions and logging them are the driver's job (router/cluster/state.py and the
router), so policies are tested with fixed snapshots and a seeded rng.

Workers with role "both" are candidates on either side. When one worker is chosen for both,
or no worker can prefill, the decision's prefill_id is None: the decode worker prefills the
prompt itself and no KV crosses the wire.

Policies: round_robin (no load), least_loaded (load; a decode worker's cached prompt blocks
count as room), cache_aware (load and the prompt blocks each worker already holds, from the
router's prefix index; the default).

Imports nothing with I/O (no redis, grpc, httpx, torch); a test checks it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.registry import Registry
from router.cluster.keys import ClusterSnapshot, WorkerInfo

__all__ = [
    "POLICIES",
    "CacheAware",
    "CacheAwareWeights",
    "LeastLoaded",
    "Policy",
    "RoundRobin",
    "RouteDecision",
    "RouteRequest",
    "cache_aware",
    "decode_blocks_needed",
    "decode_headroom",
    "least_loaded",
    "make_policy",
    "prompt_blocks",
    "round_robin",
]


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request."""

    num_prompt_tokens: int
    """Tokens in the (tokenized, templated) prompt."""
    max_tokens: int | None
    """Output tokens requested; None: up to the model's length limit."""
    cached_blocks: tuple[tuple[str, int], ...] = ()
    """(worker_id, leading prompt blocks that worker holds in its prefix cache, counted in
    its own block size), from the router's prefix index; a worker not listed holds none."""
    held_blocks: tuple[tuple[str, int], ...] = ()
    """(worker_id, blocks of any prompt the router's prefix index holds for that worker): how
    full of other prefixes its cache is; a worker not listed holds none."""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0; got {self.num_prompt_tokens}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 or None; got {self.max_tokens}")
        for name, pairs in (("cached_blocks", self.cached_blocks), ("held_blocks", self.held_blocks)):
            ids = [worker_id for worker_id, _ in pairs]
            if len(set(ids)) != len(ids):
                raise ValueError(f"{name} names a worker twice: {ids}")
            for worker_id, count in pairs:
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise ValueError(f"{name}[{worker_id!r}] must be an int >= 0; got {count!r}")
        # Looked up per worker by the policies (cached_for, held_by).
        object.__setattr__(self, "_cached", dict(self.cached_blocks))
        object.__setattr__(self, "_held", dict(self.held_blocks))

    def cached_for(self, worker_id: str) -> int:
        """Leading prompt blocks worker_id holds (0 when the index knows of none)."""
        return self._cached.get(worker_id, 0)

    def held_by(self, worker_id: str) -> int:
        """Blocks of any prompt the index holds for worker_id (0 when it knows of none)."""
        return self._held.get(worker_id, 0)


@dataclass(frozen=True)
class RouteDecision:
    """Where one request goes, and why."""

    prefill_id: str | None
    """The worker that prefills; None: the decode worker prefills the prompt itself."""
    decode_id: str
    """The worker that decodes (and reserves the request's blocks first)."""
    reason: str
    """One line for debug logs: the policy and what decided."""
    inputs: tuple[tuple[str, float], ...]
    """The numbers the choice was based on, as (name, value), for debug logs."""


class Policy(Protocol):
    """A routing policy. `choose` mutates nothing but the policy's own documented state,
    never blocks, and raises nothing for an empty or partial cluster (it returns None)."""

    def choose(
        self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random
    ) -> RouteDecision | None: ...


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    """KV blocks of block_size tokens that num_tokens fill (the last one maybe partly)."""
    return -(-num_tokens // block_size)


def _by_id(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    # Candidates in a fixed order, so a seeded rng breaks ties the same way every run.
    return sorted(workers, key=lambda w: w.worker_id)


def _prefill_id(prefill: WorkerInfo | None, decode: WorkerInfo) -> str | None:
    if prefill is None or prefill.worker_id == decode.worker_id:
        return None
    return prefill.worker_id


def round_robin(
    request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random, turn: int
) -> RouteDecision | None:
    """The turn-th pair: prefill candidates[turn % P], decode candidates[turn % D], each list
    sorted by worker_id. Uses no load, and not rng."""
    decoders = _by_id(snapshot.decode_workers())
    if not decoders:
        return None
    prefillers = _by_id(snapshot.prefill_workers())
    decode = decoders[turn % len(decoders)]
    prefill = prefillers[turn % len(prefillers)] if prefillers else None
    return RouteDecision(
        prefill_id=_prefill_id(prefill, decode),
        decode_id=decode.worker_id,
        reason=f"round_robin: turn {turn}",
        inputs=(
            ("turn", float(turn)),
            ("prefill_candidates", float(len(prefillers))),
            ("decode_candidates", float(len(decoders))),
        ),
    )


class RoundRobin:
    """round_robin with its turn counter as the only state: each `choose` that returns a
    decision advances `turn` by one. Not thread-safe (one router event loop owns it)."""

    def __init__(self, turn: int = 0) -> None:
        self.turn = turn

    def choose(
        self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random
    ) -> RouteDecision | None:
        decision = round_robin(request, snapshot, rng, self.turn)
        if decision is not None:
            self.turn += 1
        return decision


def _pick_lowest(
    workers: Sequence[WorkerInfo],
    key: Callable[[WorkerInfo], tuple[float, ...]],
    rng: random.Random,
) -> WorkerInfo:
    """The worker with the lowest key; ties broken by rng (drawn only when there is a tie)."""
    if len(workers) == 1:
        return workers[0]
    keyed = [(key(w), w) for w in _by_id(workers)]
    best = min(k for k, _ in keyed)
    tied = [w for k, w in keyed if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def decode_blocks_needed(worker: WorkerInfo, num_prompt_tokens: int, cached_blocks: int = 0) -> int:
    """New blocks the decode worker reserves for the prompt: all its blocks but the leading
    cached_blocks it already holds (those are reused, not allocated, and not sent)."""
    return max(prompt_blocks(num_prompt_tokens, worker.block_size) - cached_blocks, 0)


def decode_headroom(worker: WorkerInfo, num_prompt_tokens: int, cached_blocks: int = 0) -> int:
    """Blocks the decode worker would have left after reserving this prompt's new blocks
    (negative: it lacks that many)."""
    needed = decode_blocks_needed(worker, num_prompt_tokens, cached_blocks)
    return worker.free_blocks - worker.reserved_blocks - needed


def _pick_decode(
    request: RouteRequest, decoders: Sequence[WorkerInfo], rng: random.Random
) -> tuple[WorkerInfo, int]:
    """(decode worker, its headroom): most blocks left after reserving the prompt's blocks less
    those it already holds, then fewest running, then rng (drawn only on a full tie)."""

    def headroom_of(w: WorkerInfo) -> int:
        return decode_headroom(w, request.num_prompt_tokens, request.cached_for(w.worker_id))

    decode = _pick_lowest(decoders, lambda w: (-headroom_of(w), w.num_running), rng)
    return decode, headroom_of(decode)


def least_loaded(
    request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random
) -> RouteDecision | None:
    """Prefill: fewest queued prefill tokens, then fewest running, then rng.
    Decode: most blocks left after reserving the prompt's blocks (less those it already
    holds, request.cached_for), then fewest running, then rng. A decode worker without room is still chosen when none has room (it will refuse the
    request with the exact numbers; scarcity is the worker's answer, not the policy's)."""
    decoders = snapshot.decode_workers()
    if not decoders:
        return None
    n = request.num_prompt_tokens
    decode, headroom = _pick_decode(request, decoders, rng)
    prefillers = snapshot.prefill_workers()
    prefill = (
        _pick_lowest(prefillers, lambda w: (w.queued_prefill_tokens, w.num_running), rng)
        if prefillers
        else None
    )
    inputs: list[tuple[str, float]] = [
        ("prompt_blocks", float(prompt_blocks(n, decode.block_size))),
        ("decode_cached_blocks", float(request.cached_for(decode.worker_id))),
        ("decode_candidates", float(len(decoders))),
        ("decode_headroom_blocks", float(headroom)),
        ("decode_running", float(decode.num_running)),
        ("prefill_candidates", float(len(prefillers))),
    ]
    if prefill is not None:
        inputs += [
            ("prefill_queued_tokens", float(prefill.queued_prefill_tokens)),
            ("prefill_running", float(prefill.num_running)),
        ]
    prefill_id = _prefill_id(prefill, decode)
    where = f"prefill {prefill_id}" if prefill_id is not None else "prefill on decode worker"
    room = "" if headroom >= 0 else f" (lacks {-headroom} blocks; no decode worker has room)"
    return RouteDecision(
        prefill_id=prefill_id,
        decode_id=decode.worker_id,
        reason=f"least_loaded: {where}, decode {decode.worker_id}{room}",
        inputs=tuple(inputs),
    )


class LeastLoaded:
    """least_loaded as a Policy object. Stateless."""

    def choose(
        self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random
    ) -> RouteDecision | None:
        return least_loaded(request, snapshot, rng)


@dataclass(frozen=True)
class CacheAwareWeights:
    """How cache_aware prices a prefill worker: cost = uncached_token * prompt tokens it must
    compute + queued_token * prompt tokens queued ahead of ours. A queued token counts half:
    queued prompts are computed together in chunked batches, and a miss costs more than its own
    compute, since it also evicts another prefix from that worker's cache (measured in
    benchmarks/prefix_routing.py: 0.5 gave 0.98 of the ideal hit rate, 1.0 gave 0.89)."""

    uncached_token: float = 1.0
    """Cost of one prompt token the worker does not hold in its prefix cache (>= 0)."""
    queued_token: float = 0.5
    """Cost of one prompt token already waiting for prefill on the worker (>= 0)."""

    def __post_init__(self) -> None:
        for name in ("uncached_token", "queued_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} weight must be a number; got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} weight must be finite and >= 0; got {value!r}")
        if self.uncached_token == 0 and self.queued_token == 0:
            raise ValueError("at least one cache_aware weight must be > 0")


@dataclass(frozen=True)
class _PrefillPrice:
    cached_blocks: int
    uncached_tokens: int
    cost: float


def _prefill_price(
    worker: WorkerInfo, request: RouteRequest, weights: CacheAwareWeights
) -> _PrefillPrice:
    cached = request.cached_for(worker.worker_id)
    uncached = max(request.num_prompt_tokens - cached * worker.block_size, 0)
    cost = weights.uncached_token * uncached + weights.queued_token * worker.queued_prefill_tokens
    return _PrefillPrice(cached, uncached, cost)


def cache_aware(
    request: RouteRequest,
    snapshot: ClusterSnapshot,
    rng: random.Random,
    weights: CacheAwareWeights = CacheAwareWeights(),
) -> RouteDecision | None:
    """Prefill: lowest cost = weights.uncached_token * prompt tokens the worker does not hold
    (request.cached_for blocks of its block_size are reused) + weights.queued_token * its
    queued prefill tokens; then fewest running; then the fewest blocks the index holds for it
    (a prompt nobody holds goes where it evicts the least: three new prefixes on two idle
    workers split 2/1, not 3/0); then rng.
    Decode: most blocks left after reserving the prompt's blocks less those it holds
    (free - reserved - needed), then fewest running, then rng; chosen even when none has
    room (the worker refuses with the numbers). rng is drawn only on a full tie."""
    decoders = snapshot.decode_workers()
    if not decoders:
        return None
    n = request.num_prompt_tokens
    decode, headroom = _pick_decode(request, decoders, rng)
    prefillers = snapshot.prefill_workers()
    prefill = (
        _pick_lowest(
            prefillers,
            lambda w: (_prefill_price(w, request, weights).cost, w.num_running, request.held_by(w.worker_id)),
            rng,
        )
        if prefillers
        else None
    )
    decode_cached = request.cached_for(decode.worker_id)
    needed = decode_blocks_needed(decode, n, decode_cached)
    inputs: list[tuple[str, float]] = [
        ("prompt_tokens", float(n)),
        ("decode_candidates", float(len(decoders))),
        ("decode_prompt_blocks", float(prompt_blocks(n, decode.block_size))),
        ("decode_cached_blocks", float(decode_cached)),
        ("decode_needed_blocks", float(needed)),
        ("decode_headroom_blocks", float(headroom)),
        ("decode_running", float(decode.num_running)),
        ("prefill_candidates", float(len(prefillers))),
    ]
    prefill_id = _prefill_id(prefill, decode)
    where = "prefill on decode worker"
    if prefill is not None:
        price = _prefill_price(prefill, request, weights)
        inputs += [
            ("prefill_prompt_blocks", float(prompt_blocks(n, prefill.block_size))),
            ("prefill_cached_blocks", float(price.cached_blocks)),
            ("prefill_uncached_tokens", float(price.uncached_tokens)),
            ("prefill_queued_tokens", float(prefill.queued_prefill_tokens)),
            ("prefill_running", float(prefill.num_running)),
            ("prefill_held_blocks", float(request.held_by(prefill.worker_id))),
            ("prefill_cost", float(price.cost)),
            ("weight_uncached_token", float(weights.uncached_token)),
            ("weight_queued_token", float(weights.queued_token)),
        ]
        why = (
            f"lowest cost {price.cost:g}: {price.cached_blocks}/"
            f"{prompt_blocks(n, prefill.block_size)} blocks cached, {price.uncached_tokens} "
            f"tokens to compute, {prefill.queued_prefill_tokens} queued"
        )
        where = f"prefill {prefill_id} ({why})" if prefill_id else f"{where} ({why})"
    room = f"{headroom} blocks left" if headroom >= 0 else f"lacks {-headroom} blocks; none has room"
    return RouteDecision(
        prefill_id=prefill_id,
        decode_id=decode.worker_id,
        reason=(
            f"cache_aware: {where}, decode {decode.worker_id} (most room: {room} after "
            f"{needed} new, {decode_cached} cached)"
        ),
        inputs=tuple(inputs),
    )


class CacheAware:
    """cache_aware as a Policy object with fixed weights. Stateless."""

    def __init__(self, weights: CacheAwareWeights = CacheAwareWeights()) -> None:
        self.weights = weights

    def choose(
        self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random
    ) -> RouteDecision | None:
        return cache_aware(request, snapshot, rng, self.weights)


POLICIES: Registry[Callable[[], Policy]] = Registry("routing policy")
"""Policy factories by name; each call makes a policy with fresh state."""
POLICIES.register("round_robin", RoundRobin)
POLICIES.register("least_loaded", LeastLoaded)
POLICIES.register("cache_aware", CacheAware)


def make_policy(name: str) -> Policy:
    """A new policy by name. Raises KeyError listing the known names when name is unknown."""
    return POLICIES.get(name)()
