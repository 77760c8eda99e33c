"""`pdserve plan`'s traffic: request lengths (means or a measured file) and what they say about
max_model_len. Pure: no torch, no engine state.

The max_model_len check: a request never needs more than the traffic's longest (the file's
longest input+output, or 2x the mean request when only means are known). vLLM-style "max
concurrency" counts requests of max_model_len, so setting it far above that need (the classic
"8192 for safety") divides the concurrency the cache guarantees by the same factor.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.capacity import KVCapacity

MEAN_ONLY_FACTOR = 2
"""With only means known, the longest request is taken to be this many times the mean."""
WARN_FACTOR = 2
"""Warn when max_model_len is at least this many times the suggested length."""


@dataclass(frozen=True)
class Traffic:
    """What requests look like, in tokens."""

    mean_input_len: float
    mean_output_len: float
    longest: int | None
    """Longest input+output in the file; None when only means were given."""
    lengths: tuple[tuple[int, int], ...]
    """(input, output) of every request in the file; empty when only means were given."""
    source: str

    @property
    def mean_len(self) -> float:
        return self.mean_input_len + self.mean_output_len

    @property
    def needed_len(self) -> int:
        """Tokens the longest request needs (see the module docstring)."""
        if self.longest is not None:
            return self.longest
        return math.ceil(MEAN_ONLY_FACTOR * self.mean_len)

    @property
    def needed_reason(self) -> str:
        if self.longest is not None:
            return "the longest in the file"
        return f"{MEAN_ONLY_FACTOR} x the mean request of {self.mean_len:,.0f}"


def read_traffic(mean_input: float | None, mean_output: float | None, path: str | None) -> Traffic | None:
    """Traffic from the flags, None when none given. Raises ValueError for a half or double answer."""
    if path is not None:
        if mean_input is not None or mean_output is not None:
            raise ValueError("give either --request-lengths or --mean-input-len/--mean-output-len, not both")
        return traffic_from_lengths(read_request_lengths(Path(path)), path)
    if (mean_input is None) != (mean_output is None):
        raise ValueError("--mean-input-len and --mean-output-len go together")
    if mean_input is None or mean_output is None:
        return None
    return Traffic(mean_input, mean_output, None, (), "means given")


def traffic_from_lengths(lengths: list[tuple[int, int]], source: str) -> Traffic:
    count = len(lengths)
    return Traffic(
        mean_input_len=sum(i for i, _ in lengths) / count,
        mean_output_len=sum(o for _, o in lengths) / count,
        longest=max(i + o for i, o in lengths),
        lengths=tuple(lengths),
        source=f"{count:,} requests from {source}",
    )


def read_request_lengths(path: Path) -> list[tuple[int, int]]:
    """(input, output) token counts, one request a line: jsonl (`{"input_len": N, "output_len": M}`
    or `[N, M]`) when the name ends in .jsonl/.json, else csv (`N,M`, an optional header line).
    Raises ValueError naming the file and line; OSError when it cannot be read."""
    text = path.read_text()
    rows = _jsonl_rows(path, text) if path.suffix in (".jsonl", ".json") else _csv_rows(path, text)
    if not rows:
        raise ValueError(f"{path}: no request lengths in the file")
    return rows


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, int]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        pair = (item.get("input_len"), item.get("output_len")) if isinstance(item, dict) else item
        rows.append(_lengths(path, number, pair))
    return rows


def _csv_rows(path: Path, text: str) -> list[tuple[int, int]]:
    rows = []
    for number, cells in enumerate(csv.reader(text.splitlines()), 1):
        if not cells or not "".join(cells).strip():
            continue
        if number == 1 and not cells[0].strip().lstrip("-").isdigit():
            continue  # a header line
        rows.append(_lengths(path, number, [c.strip() for c in cells]))
    return rows


def _lengths(path: Path, number: int, pair: object) -> tuple[int, int]:
    where = f"{path}:{number}"
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise ValueError(f"{where}: expected input and output lengths, got {pair!r}")
    try:
        values = [int(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else None for v in pair]
    except ValueError:
        values = [None]
    if None in values:
        raise ValueError(f"{where}: lengths must be whole numbers, got {list(pair)!r}")
    input_len, output_len = values
    if input_len < 1 or output_len < 1:
        raise ValueError(f"{where}: lengths must be at least 1, got {input_len}, {output_len}")
    return input_len, output_len


def suggested_max_model_len(traffic: Traffic, block_size: int, model_limit: int) -> int:
    """The power of two at or above what the longest request needs, within the model's limit."""
    return min(max(1 << (traffic.needed_len - 1).bit_length(), block_size), model_limit)


def max_model_len_warnings(capacity: KVCapacity, traffic: Traffic, model_limit: int) -> list[str]:
    """Warnings about max_model_len for this traffic (empty when it fits the traffic)."""
    warnings = []
    over = sum(1 for i, o in traffic.lengths if i + o > capacity.max_model_len)
    if over:
        warnings.append(
            f"{over:,} of {len(traffic.lengths):,} requests need more than max_model_len="
            f"{capacity.max_model_len:,} tokens (the longest {traffic.longest:,}); they would be rejected."
        )
    suggested = suggested_max_model_len(traffic, capacity.block_size, model_limit)
    if capacity.max_model_len >= WARN_FACTOR * suggested:
        at_suggested = capacity.num_tokens / suggested
        factor = capacity.max_model_len / suggested
        warnings.append(
            f"max_model_len={capacity.max_model_len:,} is {factor:.1f}x the {suggested:,} tokens this "
            f"traffic needs ({traffic.needed_len:,}: {traffic.needed_reason}); max concurrency is "
            f"{capacity.max_concurrency:,.1f}x at {capacity.max_model_len:,} but {at_suggested:,.1f}x at "
            f"{suggested:,}: it costs {factor:.1f}x concurrency "
            f"({at_suggested - capacity.max_concurrency:,.1f} requests of {suggested:,} tokens). "
            f"Use --max-model-len {suggested} unless longer requests must be accepted."
        )
    return warnings
