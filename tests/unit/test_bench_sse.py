"""pdserve bench's stream reading: vLLM-, pdserve- and llama.cpp-shaped SSE streams give the
same token events, usage and end."""

from __future__ import annotations

import json

from pdserve.bench.client import _Stream
from pdserve.bench.sse import SSEDecoder, parse_chunk


def _sse(*objects) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n"
                    for o in objects)


HEAD = {"id": "x", "created": 1, "model": "m"}
VLLM_COMPLETIONS = _sse(
    {**HEAD, "object": "text_completion",
     "choices": [{"index": 0, "text": " Hello", "logprobs": None, "finish_reason": None}]},
    {**HEAD, "object": "text_completion",
     "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}]},
    {**HEAD, "object": "text_completion", "choices": [],
     "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}},
    b"[DONE]",
)
VLLM_CHAT = _sse(  # pdserve streams chat the same way: the role chunk comes before any token
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]},
    {**HEAD, "object": "chat.completion.chunk", "choices": [],
     "usage": {"prompt_tokens": 9, "total_tokens": 11, "completion_tokens": 2}},
    b"[DONE]",
)
LLAMACPP_CHAT = _sse(
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]},
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hi"}}]},
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"finish_reason": None, "index": 0, "delta": {"content": "!"}}]},
    {**HEAD, "object": "chat.completion.chunk",
     "choices": [{"finish_reason": "length", "index": 0, "delta": {}}]},
    {**HEAD, "object": "chat.completion.chunk", "choices": [],
     "usage": {"completion_tokens": 2, "prompt_tokens": 9, "total_tokens": 11}, "timings": {"predicted_n": 2}},
    b"[DONE]",
)
LLAMACPP_COMPLETIONS = _sse(
    {**HEAD, "object": "text_completion",
     "choices": [{"text": " Hello", "index": 0, "logprobs": None, "finish_reason": None}]},
    {**HEAD, "object": "text_completion",
     "choices": [{"text": " world", "index": 0, "logprobs": None, "finish_reason": None}]},
    {**HEAD, "object": "text_completion",  # the end marker carries the usage
     "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
     "usage": {"completion_tokens": 2, "prompt_tokens": 5, "total_tokens": 7}},
    b"[DONE]",
)


def _replay(stream_bytes: bytes, step: int) -> _Stream:
    """Feed the stream in pieces of `step` bytes, one millisecond apart."""
    stream, decoder = _Stream(start=0.0, prompt_len=3), SSEDecoder()
    for i in range(0, len(stream_bytes), step):
        for payload in decoder.feed(stream_bytes[i:i + step]):
            stream.add(payload, now=(i // step + 1) / 1000)
    return stream


def test_vllm_completion_stream_gives_two_tokens_and_the_usage():
    out = _replay(VLLM_COMPLETIONS, step=len(VLLM_COMPLETIONS)).output()
    assert (out.success, out.output_tokens, out.prompt_len, out.generated_text) == (True, 2, 5, " Hello world")
    assert out.itl == (0.0,)  # both tokens arrived in the same read


def test_role_chunk_is_not_the_first_token_in_vllm_or_llamacpp_chat():
    for stream_bytes in (VLLM_CHAT, LLAMACPP_CHAT):
        chunks = [parse_chunk(p) for p in SSEDecoder().feed(stream_bytes)]
        assert [c.token for c in chunks] == [False, True, True] + [False] * (len(chunks) - 3)
        out = _replay(stream_bytes, step=1).output()
        assert (out.success, out.output_tokens, out.prompt_len, out.generated_text) == (True, 2, 9, "Hi!")
        assert len(out.itl) == 1


def test_llamacpp_completion_end_marker_is_not_a_token_but_its_usage_counts():
    chunks = [parse_chunk(p) for p in SSEDecoder().feed(LLAMACPP_COMPLETIONS)]
    assert [c.token for c in chunks] == [True, True, False, False]
    assert (chunks[2].finish_reason, chunks[2].completion_tokens, chunks[3].done) == ("length", 2, True)
    out = _replay(LLAMACPP_COMPLETIONS, step=7).output()
    assert (out.output_tokens, out.generated_text, len(out.itl)) == (2, " Hello world", 1)


def test_ttft_and_itl_come_from_token_chunk_arrival_times():
    stream = _Stream(start=1.0, prompt_len=3)
    for payload, now in zip(SSEDecoder().feed(VLLM_CHAT), (1.01, 1.25, 1.3, 1.31, 1.32)):
        stream.add(payload, now)
    out = stream.output()
    assert (out.ttft, out.latency) == (0.25, 0.30000000000000004) and out.itl == (0.050000000000000044,)


def test_without_usage_output_tokens_are_counted_from_chunks():
    body = _sse({"choices": [{"text": "a", "finish_reason": None}]},
                {"choices": [{"text": "b", "finish_reason": None}]},
                {"choices": [{"text": "c", "finish_reason": "length"}]}, b"[DONE]")
    assert _replay(body, step=5).output().output_tokens == 3


def test_in_band_error_fails_the_request_with_its_message():
    body = _sse({"choices": [{"text": "a", "finish_reason": None}]},
                {"error": {"message": "decode worker failed mid-stream", "type": "InternalServerError", "code": 500}},
                b"[DONE]")
    out = _replay(body, step=len(body)).output()
    assert (out.success, out.error) == (False, "decode worker failed mid-stream")


def test_stream_cut_before_the_end_is_a_failure():
    body = _sse({"choices": [{"text": "a", "finish_reason": None}]})
    out = _replay(body, step=len(body)).output()
    assert (out.success, out.error) == (False, "the stream ended before the response finished")
    assert _replay(_sse(b"[DONE]"), step=4).output().error == "the stream ended without a token"


def test_decoder_handles_crlf_comments_split_utf8_and_a_missing_last_blank_line():
    text = ': ping\r\n\r\ndata: {"choices": [{"text": "\xe9t\xe9", "finish_reason": null}]}\r\n\r\ndata: [DONE]'
    raw = text.encode("utf-8")
    decoder, payloads = SSEDecoder(), []
    for i in range(len(raw)):
        payloads += decoder.feed(raw[i:i + 1])
    payloads += decoder.close()
    assert payloads == ['{"choices": [{"text": "\xe9t\xe9", "finish_reason": null}]}', "[DONE]"]
    assert parse_chunk(payloads[0]).text == "\xe9t\xe9" and parse_chunk(payloads[1]).done


def test_malformed_payload_is_an_error_not_an_exception():
    assert parse_chunk("{not json").error == "malformed stream data: '{not json'"
