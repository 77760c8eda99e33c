"""Routing policies: which prefill worker and which decode worker serve a request (pure).

A policy is `choose(request, snapshot, rng) -> RouteDecision | None`: it reads only its
arguments, and returns None when the snapshot has no worker that can decode. Reading Redis,
counting decisions and logging them are the driver's job (router/cluster_state.py and the
router), so policies are tested with fixed snapshots and a seeded rng.

Workers with role "both" are candidates on either side. When one worker is chosen for both,
or no worker can prefill, the decision's prefill_id is None: the decode worker prefills the
prompt itself and no KV crosses the wire.

Imports nothing with I/O (no redis, grpc, httpx, torch); a test checks it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.registry import Registry
from router.cluster_keys import ClusterSnapshot, WorkerInfo

__all__ = [
    "POLICIES",
    "LeastLoaded",
    "Policy",
    "RoundRobin",
    "RouteDecision",
    "RouteRequest",
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

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0; got {self.num_prompt_tokens}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 or None; got {self.max_tokens}")


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
    key: Callable[[WorkerInfo], tuple[int, ...]],
    rng: random.Random,
) -> WorkerInfo:
    """The worker with the lowest key; ties broken by rng (drawn only when there is a tie)."""
    ordered = _by_id(workers)
    best = min(key(w) for w in ordered)
    tied = [w for w in ordered if key(w) == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def decode_headroom(worker: WorkerInfo, num_prompt_tokens: int) -> int:
    """Blocks the decode worker would have left after reserving this prompt's blocks
    (negative: it lacks that many)."""
    needed = prompt_blocks(num_prompt_tokens, worker.block_size)
    return worker.free_blocks - worker.reserved_blocks - needed


def least_loaded(
    request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random
) -> RouteDecision | None:
    """Prefill: fewest queued prefill tokens, then fewest running, then rng.
    Decode: most blocks left after reserving the prompt's blocks, then fewest running, then
    rng. A decode worker without room is still chosen when none has room (it will refuse the
    request with the exact numbers; scarcity is the worker's answer, not the policy's)."""
    decoders = snapshot.decode_workers()
    if not decoders:
        return None
    n = request.num_prompt_tokens
    decode = _pick_lowest(decoders, lambda w: (-decode_headroom(w, n), w.num_running), rng)
    prefillers = snapshot.prefill_workers()
    prefill = (
        _pick_lowest(prefillers, lambda w: (w.queued_prefill_tokens, w.num_running), rng)
        if prefillers
        else None
    )
    headroom = decode_headroom(decode, n)
    inputs: list[tuple[str, float]] = [
        ("prompt_blocks", float(prompt_blocks(n, decode.block_size))),
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


POLICIES: Registry[Callable[[], Policy]] = Registry("routing policy")
"""Policy factories by name; each call makes a policy with fresh state."""
POLICIES.register("round_robin", RoundRobin)
POLICIES.register("least_loaded", LeastLoaded)


def make_policy(name: str) -> Policy:
    """A new policy by name. Raises KeyError listing the known names when name is unknown."""
    return POLICIES.get(name)()
