"""The scheduler's plain-data seams: a step's plan, the runner's result, what a step outputs,
a decode worker's reservation, and the scheduler's counters. No engine objects inside."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams

__all__ = [
    "EngineCoreOutput",
    "Reservation",
    "RunnerOutput",
    "ScheduledRequest",
    "SchedulerOutput",
    "SchedulerStats",
]


@dataclass(frozen=True)
class ScheduledRequest:
    """The work of one request in one step (plain data, no engine objects)."""

    request_id: str
    token_ids: tuple[int, ...]
    """Tokens whose K/V this step computes."""
    start_position: int
    """Position of token_ids[0] (= tokens already computed)."""
    block_ids: tuple[int, ...]
    """The request's whole block table after this step's allocation."""
    sample: bool
    """True when this chunk ends the known tokens, so the next token is sampled."""
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    stop_token_ids: frozenset[int]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan."""

    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()
    """Requests that ended since the last plan: the runner drops their state."""
    swap_out: tuple[tuple[int, int], ...] = ()
    """(device block, swap block) pairs to copy device -> host before the forward pass;
    the device blocks are already free in the scheduler's books (reused after the copy)."""
    swap_in: tuple[tuple[int, int], ...] = ()
    """(swap block, device block) pairs to copy host -> device before the forward pass
    (after swap_out; a plan never swaps out and in at once)."""

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be block copies to run)."""
        return not self.scheduled

    @property
    def has_copies(self) -> bool:
        return bool(self.swap_out or self.swap_in)


@dataclass(frozen=True)
class RunnerOutput:
    """What the runner returns for a plan: one sampled token per `sample` request."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    sampled_at: float | None = None
    """Unix time the sampler returned this step's tokens (None when nothing was sampled)."""


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens of one request after a step, and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int = 0
    sampled_at: float | None = None
    """Unix time new_token_ids were sampled (worker clock; None for an output with no new
    token). Travels in TokenChunk.sampled_at, for token delivery delay (sample -> client)."""


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker reserved for a prompt computed elsewhere."""

    num_cached_tokens: int
    """Prompt tokens already in this worker's prefix cache (a multiple of the block size)."""
    block_ids: tuple[int, ...]
    """Blocks to fill, in order, for the prompt tokens after the cached ones."""


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    """Preemptions of either kind (recompute or swap)."""
    num_swapped_out: int = 0
    """Preemptions by swapping a request's KV out to the swap pool."""
    num_swapped_in: int = 0
    """Swapped-out requests resumed by copying their KV back."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache at admission."""
    prefix_cache_hits: int = 0
    """Of those, tokens found there."""
    prompt_tokens: int = 0
    """Prompt tokens computed by this engine's forward passes (prefix-cache hits and KV received
    from another worker are not computed here, so not counted)."""
    generation_tokens: int = 0
    """Tokens sampled by this engine (a decode worker's first token comes from the prefill)."""
    prefill_busy_s: float = 0.0
    """Seconds of engine steps spent on prompt tokens (a step's time split by its tokens), so
    prompt_tokens / prefill_busy_s is the throughput *while busy*: an idle worker does not look slow."""
    decode_busy_s: float = 0.0
    """Seconds of engine steps spent on generated tokens (the rest of each step's time)."""
