"""The Rust routers' instant HTTP doubles answer like an OpenAI server: decode gives max_tokens
tokens (one SSE chunk each, usage, [DONE]), prefill gives one token and vLLM's kv_transfer_params."""

from __future__ import annotations

import json

from benchmarks.instant_http_workers import TOKEN_TEXT, full_body, stream_events


def _payloads(events: list[bytes]) -> list[str]:
    return [e.decode()[len("data: "):-2] for e in events]


def test_the_decode_double_streams_max_tokens_chunks_then_usage_then_done():
    body = {"prompt": "a b c", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    payloads = _payloads(stream_events(body, "decode", chat=False))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == [TOKEN_TEXT] * 3
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_the_prefill_double_answers_one_token_with_kv_transfer_params():
    answer = full_body({"prompt": [1, 2], "max_tokens": 8}, "prefill", chat=False)
    assert answer["choices"][0]["text"] == TOKEN_TEXT
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert answer["kv_transfer_params"]["do_remote_prefill"] is True


def test_the_chat_stream_carries_deltas():
    payloads = _payloads(stream_events({"messages": [], "max_tokens": 1}, "decode", chat=True))
    assert json.loads(payloads[0])["choices"][0]["delta"] == {"content": TOKEN_TEXT}
    assert payloads[-1] == "[DONE]"
