"""The seam between the router's front door and whatever produces tokens.

The HTTP (and gRPC) layers know only `GenerationBackend`: they hand it one `BackendRequest` per
output sequence and read `TokenDelta`s back. Text never crosses this seam: detokenization and
stop strings happen in the router, so a backend deals in token ids only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.sampling_params import SamplingParams
from router.serving.trace import BackendTrace
from router.serving.types import TokenLogprobs

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class BackendRequest:
    """One output sequence to generate (the router fans `n > 1` out into n of these)."""

    request_id: str
    """Unique per backend request: f"{client request id}-{choice index}"."""
    prompt_token_ids: tuple[int, ...]
    """The full prompt, chat template already applied."""
    params: SamplingParams
    """Always `n == 1`; a seeded client request gets seed + choice index here."""

    def __post_init__(self) -> None:
        if self.params.n != 1:
            raise ValueError(
                f"a backend request generates one sequence (params.n == 1), got n={self.params.n}"
            )


@dataclass(frozen=True)
class RouteInfo:
    """Where a backend placed one request and what that cost, for the per-request metadata
    (the `x-pdserve-route` header): the routing decision's inputs and the admission wait."""

    decode_id: str
    prefill_id: str | None
    """None: the decode worker prefilled the prompt itself."""
    reason: str
    """The policy's one-line reason."""
    inputs: tuple[tuple[str, float], ...]
    """The numbers the policy decided on."""
    queue_s: float
    """Seconds the request waited in the router's admission queue."""
    fallback: str | None = None
    """Why the request left its planned path (e.g. "prefill_failed"), or None."""

    def header_value(self) -> str:
        """One header line: `decode=..; prefill=..; queue_ms=..; <input>=<value>; ...`."""
        parts = [f"decode={self.decode_id}", f"prefill={self.prefill_id or '-'}",
                 f"queue_ms={self.queue_s * 1000:.1f}"]
        if self.fallback:
            parts.append(f"fallback={self.fallback}")
        parts += [f"{name}={value:g}" for name, value in self.inputs]
        return "; ".join(parts)


@dataclass(frozen=True)
class TokenDelta:
    """Tokens generated since the previous delta of the same backend request."""

    token_ids: tuple[int, ...]
    """New token ids, in order (may be empty, e.g. on a bare abort)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One entry per new token when the request asked for logprobs; empty otherwise."""
    finish_reason: FinishReason | None = None
    """Set on the last delta only: "stop" (EOS or a stop token), "length" or "abort"."""
    stop_token_id: int | None = None
    """With finish_reason "stop": the token that stopped generation (the last of token_ids)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from a prefix cache (reported on the first delta)."""
    path: str | None = None
    """How the request was served, e.g. "disaggregated" or "decode-only"; echoed to clients."""
    route: RouteInfo | None = None
    """On the first delta of a routed request: where it went and why."""
    trace: BackendTrace | None = None
    """On the first delta, from a backend that traces: filled on as the request goes on."""
    sampled_at: tuple[float, ...] = ()
    """Unix time (the worker's clock) each token was sampled; empty when the worker did not say."""

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"a delta with logprobs needs one entry per token: {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} logprobs"
            )


class GenerationBackend(Protocol):
    """Produces tokens for backend requests (a P/D cluster, a local engine, a test script)."""

    def generate(self, request: BackendRequest) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of one request; implement as an async generator.

        The last delta yielded has a finish_reason; nothing follows it. Does not block the event
        loop. Raises a `router.errors.RouterError` subclass: `Overloaded` when no worker can take
        the request now, `InvalidRequest` when a worker rejects it, `WorkerFailure` when a worker
        fails. Closing the iterator early (router saw a stop string, client went away) is always
        followed by `abort(request.request_id)`.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop generating `request_id` and free what it holds; a no-op for an unknown or
        finished id. Never raises for a request that is already gone.
        """
        ...
