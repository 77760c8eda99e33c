"""Reading an OpenAI-style SSE stream (vLLM, pdserve, llama.cpp's llama-server) into chunks.

Pure: bytes in, `Chunk`s out; the caller stamps arrival times. What counts as a generated
token, so that TTFT and ITL mean the same thing against every server:
  - a chunk with choices whose text (completions) or delta.content (chat) is a string;
  - but not a chat role announcement (delta.role with empty or null content): pdserve sends
    it before any token, so counting it would make TTFT ~0;
  - and not an end marker: empty text with a finish_reason and no token ids (llama.cpp ends
    with one; a real last token carries its text with the finish_reason).
Usage may ride on a token chunk (llama.cpp, pdserve) or come alone with empty choices (vLLM).
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass


class SSEDecoder:
    """Splits a byte stream into the data payloads of its events. Not thread-safe."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, data: bytes) -> list[str]:
        """The payloads of the events completed by `data` (multi-line data joined by \\n)."""
        self._buffer = (self._buffer + self._utf8.decode(data)).replace("\r\n", "\n")
        payloads = []
        while "\n\n" in self._buffer:
            block, self._buffer = self._buffer.split("\n\n", 1)
            payloads += _payload(block)
        return payloads

    def close(self) -> list[str]:
        """The last event when the stream ended without its blank line."""
        block, self._buffer = self._buffer + self._utf8.decode(b"", final=True), ""
        return _payload(block)


def _payload(block: str) -> list[str]:
    # "data:" then one optional space (the SSE spec); ":" lines are comments (keep-alives).
    lines = [line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")]
    return ["\n".join(lines)] if lines else []


@dataclass(frozen=True)
class Chunk:
    """What one SSE payload says."""

    done: bool = False
    """The `[DONE]` sentinel."""
    error: str | None = None
    """An in-band error (the server failed mid-stream), or a payload that is not JSON."""
    token: bool = False
    """Carries a generated token (see the module docstring)."""
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    """From `usage`, when the chunk has one."""
    completion_tokens: int | None = None
    sampled_at: tuple[float, ...] = ()
    """pdserve's `pdserve_sampled_at` (asked for with X-Pdserve-Token-Times: 1): the unix time,
    on the server's clock, each token of the chunk was sampled; empty from other servers."""


def parse_chunk(payload: str) -> Chunk:
    if payload.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return Chunk(error=f"malformed stream data: {payload[:200]!r}")
    if not isinstance(data, dict):
        return Chunk(error=f"unexpected stream data: {payload[:200]!r}")
    if "error" in data:
        err = data["error"]
        return Chunk(error=str(err.get("message", err)) if isinstance(err, dict) else str(err))
    usage = data.get("usage") or {}
    prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    choices = data.get("choices") or []
    if not choices:
        return Chunk(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    choice = choices[0]
    finish_reason = choice.get("finish_reason")
    text, token = _choice_text(choice, finish_reason)
    return Chunk(token=token, text=text or "", finish_reason=finish_reason,
                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 sampled_at=_sample_times(data.get("pdserve_sampled_at")))


def _sample_times(value: object) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(isinstance(t, (int, float)) for t in value):
        return ()
    return tuple(float(t) for t in value)


def _choice_text(choice: dict, finish_reason: str | None) -> tuple[str | None, bool]:
    if "delta" in choice:  # chat
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if "role" in delta and not text:
            return None, False
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        return None, False
    if text == "" and finish_reason is not None and not choice.get("token_ids"):
        return None, False
    return text, True
