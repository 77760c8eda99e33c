"""What the engine returns to its callers (frozen; vLLM's shapes and names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Raw logprobs (of the model's logits, before penalties and temperature) for one
    generated token; the sampler makes them, the router and workers pass them on."""

    token_id: int
    """The sampled token."""
    logprob: float
    """The sampled token's natural-log probability."""
    rank: int
    """How many tokens have a logprob >= the sampled token's (1 = the most likely)."""
    top: tuple[tuple[int, float], ...]
    """The requested number of most likely (token_id, logprob) pairs, most likely first."""


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    """1 = the most likely token."""
    decoded_token: str | None = None


TokenLogprobDict = dict[int, Logprob]
"""For one generated token: the sampled token and the top-k alternatives."""


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """"stop", "length", "abort", or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None for eos or length)."""
    logprobs: tuple[TokenLogprobDict, ...] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A request's state so far: `outputs` has n completions. For n == 1 the completion's
    fields are also readable on the request output itself (`out.text`, `out.token_ids`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> tuple[TokenLogprobDict, ...] | None:
        return self.outputs[0].logprobs
