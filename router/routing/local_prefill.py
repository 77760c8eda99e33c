"""Conditional disaggregation: a short prompt is prefilled on its decode worker when the
prefill worker it would go to is backed up (pure, like every policy).

Waiting behind thousands of queued prompt tokens costs a short prompt far more time to first
token than computing it where it will be decoded; the price is one short prefill chunk in the
decode worker's batch (a slower step for the requests decoding there). The rule is Dynamo's
shape: prefill locally when the prompt is at most max_tokens (not counting what the decode
worker already caches) AND the chosen prefill worker has at least min_queued_tokens queued.
Responses taking this path say `x-pdserve-path: colocated`, and the router counts them in
pdserve_path_fallbacks{reason="local_prefill"}.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from router.cluster.keys import ClusterSnapshot
from router.routing.policy import Policy, RouteDecision, RouteRequest

__all__ = ["LocalPrefillRule", "WithLocalPrefill", "local_prefill"]


@dataclass(frozen=True)
class LocalPrefillRule:
    """When a request skips the prefill worker. max_tokens 0 turns the rule off."""

    max_tokens: int = 0
    """Longest prompt (tokens the decode worker does not cache) prefilled on the decode worker."""
    min_queued_tokens: int = 1024
    """Only when the chosen prefill worker has at least this many prompt tokens queued."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "min_queued_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0; got {value!r}")


def local_prefill(decision: RouteDecision | None, request: RouteRequest, snapshot: ClusterSnapshot,
                  rule: LocalPrefillRule) -> RouteDecision | None:
    """`decision` with its prefill moved to the decode worker when the rule says so; otherwise
    `decision` unchanged. Reads only its arguments."""
    if decision is None or decision.prefill_id is None or rule.max_tokens == 0:
        return decision
    prefill, decode = snapshot.by_id(decision.prefill_id), snapshot.by_id(decision.decode_id)
    if prefill is None or decode is None:
        return decision
    uncached = max(request.num_prompt_tokens - request.cached_for(decode.worker_id) * decode.block_size, 0)
    queued = prefill.queued_prefill_tokens
    if uncached > rule.max_tokens or queued < rule.min_queued_tokens:
        return decision
    return replace(
        decision,
        prefill_id=None,
        reason=(f"{decision.reason}; prefill on decode {decode.worker_id}: {uncached} tokens <= "
                f"{rule.max_tokens} while {prefill.worker_id} has {queued} queued >= {rule.min_queued_tokens}"),
        inputs=decision.inputs + (("local_prefill_tokens", float(uncached)),
                                  ("skipped_prefill_queued_tokens", float(queued))),
    )


class WithLocalPrefill:
    """Any policy, then the local-prefill rule on its decision. State: the inner policy's."""

    def __init__(self, inner: Policy, rule: LocalPrefillRule) -> None:
        self.inner = inner
        self.rule = rule

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random) -> RouteDecision | None:
        return local_prefill(self.inner.choose(request, snapshot, rng), request, snapshot, self.rule)
