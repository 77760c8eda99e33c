"""Prompts from files: `sharegpt-like` (ShareGPT's JSON conversations) and `jsonl`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdserve.bench.datasets import SampleRequest, TokenizerLike

MIN_LEN = 4
"""ShareGPT pairs with a shorter prompt or answer are skipped (as vLLM does)."""
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def sharegpt_requests(
    tokenizer: TokenizerLike, path: str | Path, num_requests: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """A JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}:
    the first turn is the prompt, the second's token count the output length (unless
    output_len is given). Pairs out of vLLM's length limits are skipped; the rest are shuffled
    (seeded) and reused in order when there are fewer than num_requests."""
    entries = json.loads(Path(path).read_text())
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(entries))
    usable: list[SampleRequest] = []
    for j in order:
        turns = entries[j].get("conversations") or entries[j].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        answer_len = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if output_len is None and (prompt_len < MIN_LEN or answer_len < MIN_LEN):
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + answer_len > MAX_TOTAL_LEN:
            continue
        usable.append(SampleRequest(prompt, prompt_len, answer_len))
        if len(usable) == num_requests:
            break
    return _repeat(usable, num_requests, path)


def jsonl_requests(
    tokenizer: TokenizerLike, path: str | Path, num_requests: int, output_len: int
) -> list[SampleRequest]:
    """One JSON object per line with a "prompt" (text); its "output_len" (or "max_tokens")
    overrides output_len. Taken in file order, reused from the top when short."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line needs a string \"prompt\"")
        out = int(row.get("output_len") or row.get("max_tokens") or output_len)
        rows.append(SampleRequest(row["prompt"], len(tokenizer.encode(row["prompt"], add_special_tokens=False)), out))
        if len(rows) == num_requests:
            break
    return _repeat(rows, num_requests, path)


def _repeat(requests: list[SampleRequest], num_requests: int, path: str | Path) -> list[SampleRequest]:
    if not requests:
        raise ValueError(f"{path} holds no usable prompt")
    return [requests[i % len(requests)] for i in range(num_requests)]
