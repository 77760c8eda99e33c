"""POST /v1/chat/completions through the HTTP app: exact bodies, chunks and limits."""

from __future__ import annotations

from router.serving.backend import TokenDelta
from router.serving.types import TokenLogprobs
from tests.unit.router_doubles import CREATED, MODEL, call, make_app, sse_payloads, token_steps
from tests.unit.test_router_validation import HI_PROMPT_IDS

HI = [{"role": "user", "content": "Hi"}]
HELLO_THERE = [19556, 17, 665]  # "Hello", "!", " there"
IM_END = 2
HEAD = {"id": "chatcmpl-req-1", "object": "chat.completion", "created": CREATED, "model": MODEL}
CHUNK_HEAD = {**HEAD, "object": "chat.completion.chunk"}
ID = {"x-request-id": "req-1"}


def chat(app, **fields):
    return call(app, "POST", "/v1/chat/completions", json={"messages": HI, **fields}, headers=ID)


def delta_chunk(delta, finish=None, index=0, stopped=False, **extra):
    body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    if stopped:
        body["stop_reason"] = extra.pop("stop_reason", None)
    body["token_ids"] = extra.pop("token_ids", None)
    return {**CHUNK_HEAD, "choices": [{**body, **extra}]}


def role_chunk(index=0):
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}  # fmt: skip
    return {**CHUNK_HEAD, "choices": [choice]}


def test_chat_returns_vllms_body_and_ends_on_the_eos_token():
    app, backend = make_app(token_steps([*HELLO_THERE, IM_END], "stop", stop_token_id=IM_END))
    response = chat(app)
    assert response.status_code == 200
    message = {"role": "assistant", "content": "Hello! there", "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
    assert response.json() == {
        **HEAD,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop",
                     "stop_reason": None, "token_ids": None}],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": 31, "total_tokens": 35, "completion_tokens": 4,
                  "prompt_tokens_details": None},
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }  # fmt: skip
    assert backend.requests[0].prompt_token_ids == HI_PROMPT_IDS


def test_chat_without_max_tokens_may_fill_the_context():
    app, backend = make_app(token_steps([19556]), max_model_len=100)
    chat(app)
    assert backend.requests[0].params.max_tokens == 100 - 31


def test_max_completion_tokens_wins_over_max_tokens():
    app, backend = make_app(token_steps([19556]))
    chat(app, max_tokens=50, max_completion_tokens=5)
    assert backend.requests[0].params.max_tokens == 5


def test_chat_stream_sends_role_chunk_deltas_usage_and_done():
    app, _ = make_app(token_steps([*HELLO_THERE, IM_END], "stop", stop_token_id=IM_END))
    response = chat(app, stream=True, stream_options={"include_usage": True})
    assert response.headers["x-pdserve-path"] == "disaggregated"
    assert sse_payloads(response.text) == [
        role_chunk(),
        delta_chunk({"content": "Hello"}),
        delta_chunk({"content": "!"}),
        delta_chunk({"content": " there"}),
        delta_chunk({"content": ""}, "stop", stopped=True),
        {**CHUNK_HEAD, "choices": [],
         "usage": {"prompt_tokens": 31, "total_tokens": 35, "completion_tokens": 4}},
        "[DONE]",
    ]  # fmt: skip


def test_chat_stream_with_n_2_opens_every_choice_then_interleaves():
    app, backend = make_app(token_steps(HELLO_THERE[:1]))
    events = sse_payloads(chat(app, stream=True, n=2).text)
    assert events == [
        role_chunk(0),
        role_chunk(1),
        delta_chunk({"content": "Hello"}, "length", stopped=True),
        delta_chunk({"content": "Hello"}, "length", index=1, stopped=True),
        "[DONE]",
    ]
    assert [r.request_id for r in backend.requests] == ["b1-0", "b1-1"]


def test_chat_logprobs_have_openais_content_shape():
    lp = TokenLogprobs(19556, -0.5, 1, ((19556, -0.5), (26843, -1.25)))
    app, _ = make_app([TokenDelta((19556,), (lp,), "length")])
    response = chat(app, logprobs=True, top_logprobs=2)
    assert response.json()["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "Hello",
                "logprob": -0.5,
                "bytes": [72, 101, 108, 108, 111],
                "top_logprobs": [
                    {"token": "Hello", "logprob": -0.5, "bytes": [72, 101, 108, 108, 111]},
                    {"token": "Hi", "logprob": -1.25, "bytes": [72, 105]},
                ],
            }
        ]
    }


def test_streamed_chat_with_return_token_ids_carries_prompt_and_delta_ids():
    app, _ = make_app(token_steps(HELLO_THERE[:2]))
    events = sse_payloads(chat(app, stream=True, return_token_ids=True).text)
    assert events[0] == {**role_chunk(), "prompt_token_ids": list(HI_PROMPT_IDS)}
    assert events[1] == delta_chunk({"content": "Hello"}, token_ids=[19556])
    assert events[2] == delta_chunk({"content": "!"}, "length", stopped=True, token_ids=[17])


def test_chat_return_token_ids_lists_prompt_and_output_ids():
    app, _ = make_app(token_steps(HELLO_THERE[:2]))
    body = chat(app, return_token_ids=True).json()
    assert body["prompt_token_ids"] == list(HI_PROMPT_IDS)
    assert body["choices"][0]["token_ids"] == [19556, 17]


def test_too_long_chat_gets_400_with_vllms_context_length_message():
    app, backend = make_app(token_steps([1]), max_model_len=40)
    response = chat(app, max_tokens=10)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 10. This model's "
            "maximum context length is 40 tokens and your request has 31 input tokens "
            "(10 > 40 - 31).",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    assert backend.requests == []
