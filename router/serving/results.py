"""What RouterService returns: API-neutral results that router.api.openai_encode turns into JSON."""

from __future__ import annotations

from dataclasses import dataclass

from router.errors import RouterError


@dataclass(frozen=True)
class Logprob:
    """One candidate token at a position, decoded."""

    token_id: int
    token: str
    """The token's own text (special tokens spelled out), as vLLM reports it."""
    logprob: float


@dataclass(frozen=True)
class PositionLogprobs:
    """The sampled token at one position and the most likely alternatives."""

    sampled: Logprob
    top: tuple[Logprob, ...]
    """The top-k alternatives the request asked for, most likely first."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens served from a prefix cache; None unless prompt token details are on."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ResponseHead:
    """What every response and chunk of one request repeats."""

    response_id: str
    """e.g. "cmpl-<request id>" or "chatcmpl-<request id>"."""
    created: int
    """Unix seconds."""
    model: str
    path: str | None
    """How the backend served it (first one reported), for the x-pdserve-path header."""
    route: str | None = None
    """The first backend request's placement (RouteInfo.header_value), for x-pdserve-route."""


@dataclass(frozen=True)
class ChoiceUpdate:
    """New output of one choice (one backend request), ready to stream."""

    index: int
    text: str
    """Text to append (echoed prompt included on a choice's first update)."""
    token_ids: tuple[int, ...]
    """Token ids consumed since the last update (a stop token included, though not in text)."""
    logprobs: tuple[PositionLogprobs, ...] | None
    """One entry per token id when logprobs were asked for; None otherwise."""
    finish_reason: str | None
    stop_reason: int | str | None
    """The stop string or user stop token id that ended the choice; None for EOS/length."""
    usage: Usage | None = None
    """This choice's running usage, when the client asked for continuous usage stats."""
    sampled_at: tuple[float, ...] = ()
    """Unix time (worker clock) each of token_ids was sampled, when the backend said; else empty."""


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streaming response."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[PositionLogprobs, ...] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class CompletionResult:
    """A whole non-streaming (chat) completion."""

    head: ResponseHead
    choices: tuple[Choice, ...]
    usage: Usage
    prompt_token_ids: tuple[tuple[int, ...], ...]
    """Per prompt; choice i belongs to prompt i // n."""
    n: int


@dataclass(frozen=True)
class UsageReport:
    """The last event of a stream whose client asked for usage."""

    usage: Usage


@dataclass(frozen=True)
class StreamFailure:
    """The stream failed after it started; the client gets this in-band, then [DONE]."""

    error: RouterError


StreamEvent = ChoiceUpdate | UsageReport | StreamFailure


@dataclass(frozen=True)
class ModelCard:
    """The served model, for /v1/models."""

    id: str
    created: int
    root: str
    """Where the model was loaded from (vLLM reports the model path here)."""
    max_model_len: int


@dataclass(frozen=True)
class TokenizeResult:
    tokens: tuple[int, ...]
    max_model_len: int
    token_strs: tuple[str, ...] | None
    """Each token's vocabulary spelling, when asked for."""


@dataclass(frozen=True)
class DetokenizeResult:
    prompt: str
