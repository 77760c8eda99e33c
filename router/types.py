"""Plain values the router shares with its backends (pure: no tokenizer, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one generated position, as the sampler saw them."""

    token_id: int
    """The sampled token."""
    logprob: float
    """Natural-log probability of the sampled token."""
    rank: int
    """1-based rank of the sampled token among all tokens (1 = most likely)."""
    top: tuple[tuple[int, float], ...]
    """The most likely (token id, logprob) pairs, most likely first; as many as requested."""
