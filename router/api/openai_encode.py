"""Service results -> the JSON and SSE lines of vLLM's OpenAI-compatible server.

Shapes follow vLLM: whole responses list every field (null when unset); stream chunks carry
only the fields vLLM sets on them (it dumps chunks with exclude_unset), and the usage chunk has
empty `choices`. Logprobs are clamped at -9999.0 as OpenAI does for -inf.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson

from router.errors import RouterError, http_error
from router.serving.results import (
    Choice,
    ChoiceUpdate,
    CompletionResult,
    DetokenizeResult,
    Logprob,
    ModelCard,
    PositionLogprobs,
    ResponseHead,
    StreamFailure,
    TokenizeResult,
    Usage,
    UsageReport,
)
from router.serving.service import ResponseStream

JSON = dict[str, Any]
SSE_DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0


def dumps(body: object) -> bytes:
    """Compact UTF-8 JSON, like pydantic's model_dump_json. orjson: a chunk costs ~1/5 of
    json.dumps, and the router encodes one per streamed token (benchmarks/router_overhead.py)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # text that is not valid Unicode (lone surrogates): escape it
        return json.dumps(body, separators=(",", ":")).encode("ascii")


def sse(body: object) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


def error_body(error: RouterError) -> JSON:
    return http_error(error).body()


def models_body(card: ModelCard) -> JSON:
    model = {
        "id": card.id,
        "object": "model",
        "created": card.created,
        "owned_by": "pdserve",
        "root": card.root,
        "parent": None,
        "max_model_len": card.max_model_len,
        "permission": [],
    }
    return {"object": "list", "data": [model]}


def tokenize_body(result: TokenizeResult) -> JSON:
    return {
        "count": len(result.tokens),
        "max_model_len": result.max_model_len,
        "tokens": list(result.tokens),
        "token_strs": None if result.token_strs is None else list(result.token_strs),
    }


def detokenize_body(result: DetokenizeResult) -> JSON:
    return {"prompt": result.prompt}


def usage_body(usage: Usage, *, with_unset: bool) -> JSON:
    """`with_unset`: list prompt_tokens_details even when null (whole responses do)."""
    body: JSON = {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    elif with_unset:
        body["prompt_tokens_details"] = None
    return body


def _head(head: ResponseHead, obj: str) -> JSON:
    return {"id": head.response_id, "object": obj, "created": head.created, "model": head.model}


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def completion_logprobs(positions: tuple[PositionLogprobs, ...], text_offset: int) -> JSON:
    """Legacy completions logprobs; each top_logprobs dict holds the sampled token and top-k."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for position in positions:
        tokens.append(position.sampled.token)
        token_logprobs.append(_clamp(position.sampled.logprob))
        top = {position.sampled.token: _clamp(position.sampled.logprob)}
        top.update((alt.token, _clamp(alt.logprob)) for alt in position.top)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(position.sampled.token)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def _chat_logprob(lp: Logprob) -> JSON:
    return {
        "token": lp.token,
        "logprob": _clamp(lp.logprob),
        "bytes": list(lp.token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(positions: tuple[PositionLogprobs, ...]) -> JSON:
    content = [
        {**_chat_logprob(p.sampled), "top_logprobs": [_chat_logprob(alt) for alt in p.top]}
        for p in positions
    ]
    return {"content": content}


def _ids(ids: tuple[int, ...], wanted: bool) -> list[int] | None:
    return list(ids) if wanted else None


def completion_body(result: CompletionResult, return_token_ids: bool) -> JSON:
    prompt_ids = result.prompt_token_ids

    def choice(c: Choice) -> JSON:
        return {
            "index": c.index,
            "text": c.text,
            "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, 0),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": _ids(c.token_ids, return_token_ids),
            "prompt_logprobs": None,
            "prompt_token_ids": _ids(prompt_ids[c.index // result.n], return_token_ids),
        }

    return {
        **_head(result.head, "text_completion"),
        "choices": [choice(c) for c in result.choices],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body(result.usage, with_unset=True),
    }


def chat_body(result: CompletionResult, return_token_ids: bool) -> JSON:
    def choice(c: Choice) -> JSON:
        message = {
            "role": "assistant",
            "content": c.text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        return {
            "index": c.index,
            "message": message,
            "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": _ids(c.token_ids, return_token_ids),
        }

    return {
        **_head(result.head, "chat.completion"),
        "choices": [choice(c) for c in result.choices],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body(result.usage, with_unset=True),
        "prompt_logprobs": None,
        "prompt_token_ids": _ids(result.prompt_token_ids[0], return_token_ids),
    }


class ChunkEncoder(Protocol):
    def opening(self) -> list[JSON]: ...
    def update(self, update: ChoiceUpdate) -> JSON: ...
    def usage(self, usage: Usage) -> JSON: ...


class CompletionChunks:
    """Chunks of a /v1/completions stream; tracks each choice's text offset."""

    def __init__(self, stream: ResponseStream, return_token_ids: bool) -> None:
        self._stream = stream
        self._return_ids = return_token_ids
        self._text_len = [0] * stream.num_choices
        self._sent_prompt = [False] * stream.num_choices

    def opening(self) -> list[JSON]:
        return []

    def update(self, u: ChoiceUpdate) -> JSON:
        logprobs = None
        if u.logprobs is not None:
            logprobs = completion_logprobs(u.logprobs, self._text_len[u.index])
        self._text_len[u.index] += len(u.text)
        prompt_ids = None
        if self._return_ids and not self._sent_prompt[u.index]:
            self._sent_prompt[u.index] = True
            prompt_ids = list(self._stream.prompt_token_ids[u.index // self._stream.n])
        choice = {
            "index": u.index,
            "text": u.text,
            "logprobs": logprobs,
            "finish_reason": u.finish_reason,
            "stop_reason": u.stop_reason,
            "prompt_token_ids": prompt_ids,
            "token_ids": _ids(u.token_ids, self._return_ids),
        }
        return _with_usage({**_head(self._stream.head, "text_completion"), "choices": [choice]}, u)

    def usage(self, usage: Usage) -> JSON:
        body = usage_body(usage, with_unset=False)
        return {**_head(self._stream.head, "text_completion"), "choices": [], "usage": body}


class ChatChunks:
    """Chunks of a /v1/chat/completions stream: a role chunk per choice first."""

    def __init__(self, stream: ResponseStream, return_token_ids: bool) -> None:
        self._stream = stream
        self._return_ids = return_token_ids

    def opening(self) -> list[JSON]:
        chunks = []
        for i in range(self._stream.num_choices):
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            chunk = {**_head(self._stream.head, "chat.completion.chunk"), "choices": [choice]}
            if self._return_ids:
                chunk["prompt_token_ids"] = list(self._stream.prompt_token_ids[0])
            chunks.append(chunk)
        return chunks

    def update(self, u: ChoiceUpdate) -> JSON:
        choice: JSON = {
            "index": u.index,
            "delta": {"content": u.text},
            "logprobs": None if u.logprobs is None else chat_logprobs(u.logprobs),
            "finish_reason": u.finish_reason,
        }
        if u.finish_reason is not None:
            choice["stop_reason"] = u.stop_reason
        choice["token_ids"] = _ids(u.token_ids, self._return_ids)
        head = _head(self._stream.head, "chat.completion.chunk")
        return _with_usage({**head, "choices": [choice]}, u)

    def usage(self, usage: Usage) -> JSON:
        body = usage_body(usage, with_unset=False)
        return {**_head(self._stream.head, "chat.completion.chunk"), "choices": [], "usage": body}


TOKEN_TIMES_HEADER = "x-pdserve-token-times"
"""Request header: "1" adds each token's sample time to the SSE chunks (WithTokenTimes)."""


class WithTokenTimes:
    """A ChunkEncoder that adds `"pdserve_sampled_at": [unix seconds per token]` (the worker's
    clock) to each chunk whose tokens' sample times the backend reported, so a client can
    measure token delivery delay (receive time minus sample time). Opt-in: a pdserve field."""

    def __init__(self, inner: ChunkEncoder) -> None:
        self._inner = inner

    def opening(self) -> list[JSON]:
        return self._inner.opening()

    def update(self, u: ChoiceUpdate) -> JSON:
        chunk = self._inner.update(u)
        if u.sampled_at:
            chunk["pdserve_sampled_at"] = list(u.sampled_at)
        return chunk

    def usage(self, usage: Usage) -> JSON:
        return self._inner.usage(usage)


def _with_usage(chunk: JSON, u: ChoiceUpdate) -> JSON:
    if u.usage is not None:
        chunk["usage"] = {
            "prompt_tokens": u.usage.prompt_tokens,
            "completion_tokens": u.usage.completion_tokens,
            "total_tokens": u.usage.total_tokens,
        }
    return chunk


async def sse_lines(stream: ResponseStream, chunks: ChunkEncoder) -> AsyncIterator[bytes]:
    """The SSE lines of a stream, ending with [DONE]; a failure arrives in-band before it."""
    for chunk in chunks.opening():
        yield sse(chunk)
    async for event in stream:
        if isinstance(event, StreamFailure):
            yield sse(error_body(event.error))
        elif isinstance(event, UsageReport):
            yield sse(chunks.usage(event.usage))
        elif event.text or event.token_ids or event.finish_reason is not None:
            yield sse(chunks.update(event))
    yield SSE_DONE
