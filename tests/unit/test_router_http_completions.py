"""POST /v1/completions through the HTTP app, with a scripted backend: exact bodies and chunks."""

from __future__ import annotations

from router.serving.backend import TokenDelta
from router.serving.types import TokenLogprobs
from tests.unit.router_doubles import (
    CREATED,
    MODEL,
    PATH,
    call,
    make_app,
    sse_payloads,
    token_steps,
)

PARIS = [7042, 314, 9239, 30, 378, 1112]  # " Paris", " is", " nice", ".", " The", " end"
HEAD = {"id": "cmpl-req-1", "object": "text_completion", "created": CREATED, "model": MODEL}
ID = {"x-request-id": "req-1"}


def choice(text, finish=None, stop=None, index=0, **extra):
    return {
        "index": index, "text": text, "logprobs": None, "finish_reason": finish,
        "stop_reason": stop, "token_ids": None, "prompt_logprobs": None,
        "prompt_token_ids": None, **extra,
    }  # fmt: skip


def chunk(text, finish=None, stop=None, index=0, **extra):
    body = {
        "index": index, "text": text, "logprobs": None, "finish_reason": finish,
        "stop_reason": stop, "prompt_token_ids": None, "token_ids": None, **extra,
    }  # fmt: skip
    return {**HEAD, "choices": [body]}


def usage(prompt, completion, **extra):
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, **extra}  # fmt: skip


def test_completion_returns_vllms_body_with_path_and_request_id_headers():
    app, backend = make_app(token_steps(PARIS[:3]))
    body = {"prompt": "Hello", "max_tokens": 3}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert response.status_code == 200
    assert response.json() == {
        **HEAD,
        "choices": [choice(" Paris is nice", "length")],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(1, 3, prompt_tokens_details=None),
    }
    assert response.headers["x-pdserve-path"] == PATH
    assert response.headers["x-request-id"] == "req-1"
    assert [(r.request_id, r.prompt_token_ids, r.params.max_tokens) for r in backend.requests] == [
        ("b1-0", (19556,), 3)
    ]


def test_stream_sends_one_chunk_per_delta_then_usage_then_done():
    app, _ = make_app(token_steps(PARIS[:3]))
    options = {"include_usage": True}
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "stream_options": options}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-pdserve-path"] == PATH
    assert sse_payloads(response.text) == [
        chunk(" Paris"),
        chunk(" is"),
        chunk(" nice", "length"),
        {**HEAD, "choices": [], "usage": usage(1, 3)},
        "[DONE]",
    ]


def test_stream_without_include_usage_has_no_usage_chunk():
    app, _ = make_app(token_steps(PARIS[:2]))
    body = {"prompt": "Hello", "stream": True}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert sse_payloads(response.text) == [chunk(" Paris"), chunk(" is", "length"), "[DONE]"]


def test_continuous_usage_stats_put_running_usage_on_every_chunk():
    app, _ = make_app(token_steps(PARIS[:2]))
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "Hello", "stream": True, "stream_options": options}
    events = sse_payloads(call(app, "POST", "/v1/completions", json=body, headers=ID).text)
    running = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert events[0] == {**chunk(" Paris"), "usage": running}
    assert events[2] == {**HEAD, "choices": [], "usage": usage(1, 2)}


def test_stop_string_across_tokens_truncates_and_aborts_the_backend():
    app, backend = make_app(token_steps(PARIS))
    body = {"prompt": "Hello", "max_tokens": 6, "stop": ["nice."]}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert response.json()["choices"] == [choice(" Paris is ", "stop", "nice.")]
    assert response.json()["usage"] == usage(1, 4, prompt_tokens_details=None)
    assert backend.aborted == ["b1-0"]


def test_streamed_stop_string_ends_the_stream_and_aborts_the_backend():
    app, backend = make_app(token_steps(PARIS))
    body = {"prompt": "Hello", "max_tokens": 6, "stop": ["nice."], "stream": True}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert sse_payloads(response.text) == [
        chunk(" Paris"),
        chunk(" is"),
        chunk(" "),
        chunk("", "stop", "nice."),
        "[DONE]",
    ]
    assert backend.aborted == ["b1-0"]


def test_n_2_fans_out_two_seeded_backend_requests():
    app, backend = make_app(
        lambda r: token_steps(PARIS[:1] if r.request_id.endswith("0") else PARIS[4:6])
    )
    body = {"prompt": "Hello", "n": 2, "seed": 7, "max_tokens": 2}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert [(r.request_id, r.params.n, r.params.seed) for r in backend.requests] == [
        ("b1-0", 1, 7),
        ("b1-1", 1, 8),
    ]
    assert response.json()["choices"] == [
        choice(" Paris", "length"),
        choice(" The end", "length", index=1),
    ]
    assert response.json()["usage"] == usage(1, 3, prompt_tokens_details=None)


def test_two_prompts_times_n_2_are_four_choices_in_prompt_order():
    app, backend = make_app(token_steps(PARIS[:1]))
    body = {"prompt": ["Hello", "Hi"], "n": 2, "max_tokens": 1, "return_token_ids": True}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert [(r.request_id, r.prompt_token_ids) for r in backend.requests] == [
        ("b1-0", (19556,)),
        ("b1-1", (19556,)),
        ("b1-2", (26843,)),
        ("b1-3", (26843,)),
    ]
    choices = response.json()["choices"]
    assert [(c["index"], c["prompt_token_ids"], c["token_ids"]) for c in choices] == [
        (0, [19556], [7042]),
        (1, [19556], [7042]),
        (2, [26843], [7042]),
        (3, [26843], [7042]),
    ]
    assert response.json()["usage"] == usage(2, 4, prompt_tokens_details=None)


def test_logprobs_have_the_legacy_completions_shape():
    steps = [
        TokenDelta((7042,), (TokenLogprobs(7042, -0.25, 1, ((7042, -0.25), (4649, -2.0))),)),
        TokenDelta((314,), (TokenLogprobs(314, -3.0, 2, ((30, -0.5), (314, -3.0))),), "length"),
    ]
    app, backend = make_app(steps)
    body = {"prompt": "Hello", "max_tokens": 2, "logprobs": 1}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert backend.requests[0].params.logprobs == 1
    assert response.json()["choices"][0]["logprobs"] == {
        "text_offset": [0, 6],
        "token_logprobs": [-0.25, -3.0],
        "tokens": [" Paris", " is"],
        "top_logprobs": [{" Paris": -0.25}, {" is": -3.0, ".": -0.5}],
    }


def test_streamed_logprobs_continue_the_text_offset():
    lp = TokenLogprobs(314, float("-inf"), 9, ())
    steps = [
        TokenDelta((7042,), (TokenLogprobs(7042, -0.25, 1, ()),)),
        TokenDelta((314,), (lp,), "length"),
    ]
    app, _ = make_app(steps)
    body = {"prompt": "Hello", "logprobs": 0, "stream": True}
    events = sse_payloads(call(app, "POST", "/v1/completions", json=body, headers=ID).text)
    assert events[1]["choices"][0]["logprobs"] == {
        "text_offset": [6],
        "token_logprobs": [-9999.0],
        "tokens": [" is"],
        "top_logprobs": [{" is": -9999.0}],
    }


def test_streamed_return_token_ids_sends_prompt_ids_on_the_first_chunk_only():
    app, _ = make_app(token_steps(PARIS[:2]))
    body = {"prompt": "Hello", "stream": True, "return_token_ids": True}
    events = sse_payloads(call(app, "POST", "/v1/completions", json=body, headers=ID).text)
    assert events[:2] == [
        chunk(" Paris", prompt_token_ids=[19556], token_ids=[7042]),
        chunk(" is", "length", token_ids=[314]),
    ]


def test_echo_prepends_the_prompt():
    app, _ = make_app(token_steps(PARIS[:2]))
    body = {"prompt": "Hello", "echo": True}
    response = call(app, "POST", "/v1/completions", json=body, headers=ID)
    assert response.json()["choices"][0]["text"] == "Hello Paris is"


def test_generated_request_id_is_echoed_but_the_backend_gets_the_service_id():
    app, backend = make_app(token_steps(PARIS[:1]))
    response = call(app, "POST", "/v1/completions", json={"prompt": "Hello"})
    request_id = response.headers["x-request-id"]
    assert len(request_id) == 32
    assert response.json()["id"] == f"cmpl-{request_id}"
    assert backend.requests[0].request_id == "b1-0"
