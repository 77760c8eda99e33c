"""Synthetic prompts of exact token lengths: the `random` and `prefix` datasets.

A prompt is built as token ids, decoded to text, and re-encoded; when the round trip changes
the count (merges at token boundaries), the ids are truncated or topped up and tried again,
so the text the server tokenizes has the planned length (almost always exactly; the length
actually reached is what `prompt_len` records). Special tokens never appear in prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

FIT_ATTEMPTS = 10


class TokenizerLike(Protocol):
    """What the datasets need (engine.tokenizer.Tokenizer has it)."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark run."""

    prompt: str
    """Completion prompt, or the user message for /v1/chat/completions."""
    prompt_len: int
    """Tokens of `prompt` without special tokens (the server's usage count replaces it)."""
    expected_output_len: int
    """max_tokens to ask for."""


def num_special_tokens_to_add(tokenizer: TokenizerLike) -> int:
    """Tokens the tokenizer adds around a text (e.g. BOS)."""
    return len(tokenizer.encode("a", add_special_tokens=True)) - len(tokenizer.encode("a", add_special_tokens=False))


def allowed_token_ids(tokenizer: TokenizerLike) -> np.ndarray:
    special = set(tokenizer.all_special_ids)
    return np.array([t for t in range(tokenizer.vocab_size) if t not in special], dtype=np.int64)


def fit_to_length(
    tokenizer: TokenizerLike, ids: list[int], target: int, allowed: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """(text, its token count): text whose encoding has `target` tokens when a few rounds of
    decode -> encode -> truncate / top up reach it; else the closest last attempt."""
    count = len(ids)
    text = ""
    for _ in range(FIT_ATTEMPTS):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        count = len(again)
        if count == target:
            return text, count
        if count > target:
            ids = again[:target]
        else:
            ids = again + allowed[rng.integers(0, len(allowed), size=target - count)].tolist()
    return text, count


def length_bounds(length: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """vLLM's integer range [floor(L (1 - r)), ceil(L (1 + r))], both ends at least `minimum`."""
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return low, high


def random_requests(
    tokenizer: TokenizerLike,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's `random` dataset: lengths uniform in the range-ratio interval around the means,
    a shared random prefix of prefix_len tokens, then a run of consecutive allowed token ids
    from a random offset. Input lengths exclude the tokens the server adds (BOS)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1); got {range_ratio}")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - num_special_tokens_to_add(tokenizer))
    in_low, in_high = length_bounds(real_input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio, minimum=1)
    if prefix_len + in_low < 1:
        raise ValueError(f"--random-input-len {input_len} leaves prompts with no tokens; raise it")
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    allowed = allowed_token_ids(tokenizer)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len else []
    requests = []
    for i in range(num_requests):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        text, count = fit_to_length(tokenizer, prefix + inner, prefix_len + int(input_lens[i]), allowed, rng)
        requests.append(SampleRequest(text, count, int(output_lens[i])))
    return requests


def prefix_requests(
    tokenizer: TokenizerLike,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's `prefix_repetition` dataset: num_prefixes random prefixes, each shared by its
    share of the requests (request i uses prefix i mod num_prefixes, so there are exactly
    num_requests), each followed by its own random suffix; then shuffled. Every request of
    one prefix starts with the same text, so a server's prefix cache can reuse it."""
    if num_prefixes < 1 or num_prefixes > num_requests:
        raise ValueError(f"num_prefixes must be in [1, num_prompts={num_requests}]; got {num_prefixes}")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)

    def random_text(length: int) -> str:
        ids = allowed[rng.integers(0, len(allowed), size=length)].tolist()
        return fit_to_length(tokenizer, ids, length, allowed, rng)[0]

    prefixes = [random_text(prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        prompt = prefixes[i % num_prefixes] + random_text(suffix_len)
        requests.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), output_len))
    order = rng.permutation(num_requests)
    return [requests[j] for j in order]
