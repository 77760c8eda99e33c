"""Per-request sampling parameters, with vLLM's field names, defaults and validation messages.

Pure Python (no torch): the router validates requests with this class before anything reaches
a worker, and the same frozen value travels with the request to the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5

# The most top logprobs a request may ask for per token (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    Normalised at construction: ``stop``/``stop_token_ids`` become tuples, ``top_k=-1``
    becomes 0, and a greedy request (temperature below 1e-5) has top_p/top_k/min_p reset
    to their "off" values, as vLLM does, so the sampler never filters a greedy row.
    """

    n: int = 1
    """Number of output sequences to return for the prompt."""
    temperature: float = 1.0
    """Divides the logits before sampling; below 1e-5 means greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability sums to top_p; in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens (ties at the k-th value are kept); 0 (or -1) = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's; in [0, 1]."""
    seed: int | None = None
    """Seed of this request's own random generator, so its samples do not depend on the batch."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated; in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output; > 0."""
    stop: tuple[str, ...] = ()
    """Strings that end generation when they appear in the output (a str or list is accepted)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation, in addition to the model's end-of-sequence ids."""
    include_stop_str_in_output: bool = False
    """Whether the matched stop string is kept at the end of the output text."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (until max_tokens or a stop)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None = up to the model's context length."""
    min_tokens: int = 0
    """Stop tokens are masked until this many tokens have been generated."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20); None = off."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized output text."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))
        if self.top_k == -1:
            # vLLM quietly accepts -1 as "off"; one spelling keeps the sampler simple.
            object.__setattr__(self, "top_k", 0)
        self._verify_args()
        if self.is_greedy:
            # Filters cannot change an argmax; resetting them keeps greedy rows on the fast path.
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "min_p", 0.0)

    @classmethod
    def greedy(cls, **kwargs: Any) -> SamplingParams:
        """Parameters for greedy (argmax) decoding; other fields as given."""
        return cls(temperature=0.0, **kwargs)

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def _verify_args(self) -> None:
        _verify_counts(self)
        _verify_penalties(self)
        _verify_filters(self)
        _verify_lengths(self)
        _verify_logprobs(self)


def _as_str_tuple(stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    stop = tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must contain only strings, got {list(stop)}.")
    if any(not s for s in stop):
        raise ValueError("stop cannot contain an empty string.")
    return stop


def _as_int_tuple(ids: list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    ids = tuple(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"stop_token_ids must contain only integers, got {list(ids)}.")
    return ids


def _verify_counts(p: SamplingParams) -> None:
    if not isinstance(p.n, int):
        raise ValueError(f"n must be an int, but is of type {type(p.n)}")
    if p.n < 1:
        raise ValueError(f"n must be at least 1, got {p.n}.")


def _verify_penalties(p: SamplingParams) -> None:
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
    if not p.repetition_penalty > 0.0:  # also rejects NaN
        raise ValueError(
            f"repetition_penalty must be greater than zero, got {p.repetition_penalty}."
        )


def _verify_filters(p: SamplingParams) -> None:
    if not p.temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be non-negative, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not isinstance(p.top_k, int):
        raise ValueError(f"top_k must be an integer, got {type(p.top_k).__name__}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be 0 (disable), or at least 1, got {p.top_k}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")


def _verify_lengths(p: SamplingParams) -> None:
    if p.max_tokens is not None and p.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {p.max_tokens}.")
    if p.min_tokens < 0:
        raise ValueError(
            f"min_tokens must be greater than or equal to 0, got {p.min_tokens}."
        )
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(
            "min_tokens must be less than or equal to "
            f"max_tokens={p.max_tokens}, got {p.min_tokens}."
        )


def _verify_logprobs(p: SamplingParams) -> None:
    if p.logprobs is None:
        return
    if p.logprobs < 0:
        raise ValueError(f"logprobs must be non-negative, got {p.logprobs}.")
    if p.logprobs > MAX_LOGPROBS:
        raise ValueError(
            f"Requested sample logprobs of {p.logprobs}, "
            f"which is greater than max allowed: {MAX_LOGPROBS}"
        )
