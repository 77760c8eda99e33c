"""One P/D request's plain data in the router (router/routing/cluster_backend.py): where it was
placed, what admission gave it, its progress while it streams; and the checks that need only
the cluster snapshot (it can never fit; the policy's view of it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from proto.pdserve.v1 import common_pb2, worker_pb2
from router.cluster.state import ClusterSnapshot
from router.errors import InvalidRequest
from router.routing.policy import RouteDecision, RouteRequest
from router.routing.prefix_index import PromptHashes
from router.serving.backend import BackendRequest, RouteInfo, TokenDelta
from router.serving.trace import BackendTrace

RouteRequestBuilder = Callable[[PromptHashes, "int | None", ClusterSnapshot], RouteRequest]
"""Builds a policy's view of a request (the prefix index fills in cached blocks, reading the
prompt's block hashes, which the PromptHashes keeps for the request's later readers)."""


def plain_route_request(prompt: PromptHashes, max_tokens: int | None, snapshot: ClusterSnapshot) -> RouteRequest:
    return RouteRequest(len(prompt), max_tokens)


@dataclass
class _Placement:
    decode_address: str
    block_size: int
    prefill_address: str | None = None
    decode_link: str = ""
    """The workers' link addresses ("" for none: gRPC), for their aborts."""
    prefill_link: str = ""


@dataclass(frozen=True)
class _Admitted:
    snapshot: ClusterSnapshot
    decision: RouteDecision
    decode_id: str
    stream: object  # grpc.aio stream of DecodeEvent
    ticket: worker_pb2.Ticket
    sampling: common_pb2.SamplingParams
    """The request's sampling parameters as the Decode call sent them (the Prefill call too)."""


@dataclass
class _Run:
    """One request's progress through generate(): what its end (finally) must settle."""

    request: BackendRequest
    admitted: _Admitted
    trace: BackendTrace
    queue_s: float
    path: str
    route: RouteInfo | None
    """Rides on the first delta, then None."""
    untold: BackendTrace | None
    """The trace until a delta has carried it."""
    generated: int = 0
    finished: bool = False
    silent: bool = False
    late_prefill: asyncio.Task | None = None
    """The Prefill call when the decode stream brought the first token before its reply."""
    pending: asyncio.Task | None = None
    """A stream read the first-token race left running."""
    skip: int = 0
    """Tokens the stream will repeat that the client already has."""

    def count(self, delta: TokenDelta) -> TokenDelta:
        self.generated += len(delta.token_ids)
        self.finished = delta.finish_reason is not None
        return delta


def check_fits_capacity(num_prompt_tokens: int, max_tokens: int | None, snapshot: ClusterSnapshot) -> None:
    """Raises InvalidRequest, with the numbers, when prompt + max_tokens exceeds the whole KV
    cache of every decode worker (it could never run, however long it waited)."""
    decoders = snapshot.decode_workers()
    if not decoders or max_tokens is None:
        return
    largest = max(decoders, key=lambda w: w.total_blocks * w.block_size)
    holds = largest.total_blocks * largest.block_size
    need = num_prompt_tokens + max_tokens
    if need > holds:
        raise InvalidRequest(
            f"This request needs {need:,} tokens of KV cache ({num_prompt_tokens:,} prompt + "
            f"{max_tokens:,} max_tokens), but the largest decode worker holds {holds:,} tokens "
            f"({largest.total_blocks:,} blocks x {largest.block_size}). Reduce the prompt or "
            "max_tokens.",
            param="max_tokens",
        )
