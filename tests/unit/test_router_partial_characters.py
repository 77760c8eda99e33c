"""A character cut by max_tokens or a stop token: the HTTP and gRPC answers never end in U+FFFD.

The real SmolLM2 tokenizer splits emoji and CJK characters over several byte-level tokens; the
scripted backend ends the request after only some of them. As in vLLM, the unfinished character
is held back while streaming and dropped at the end; a genuine U+FFFD mid-text is kept.
"""

from __future__ import annotations

import pytest

from tests.unit.router_doubles import call, make_app, smollm2_tokenizer, sse_payloads, token_steps

GRINNING = [10813, 242, 218]  # "😀" as three byte-level tokens
TOKYO = [30679, 126, 16736, 122]  # "東京": two tokens per character
IM_END = 2

CASES = [
    # (output token ids, finish, stop token id, text the client gets)
    ([*smollm2_tokenizer().encode("Hi "), *GRINNING[:2]], "length", None, "Hi "),
    (TOKYO[:3], "length", None, "東"),
    ([*TOKYO[:3], IM_END], "stop", IM_END, "東"),
    ([81, 24211, 82], "length", None, "a\ufffdb"),  # "a\ufffdb": a real U+FFFD, kept
]


def _body(stream: bool) -> dict:
    return {"prompt": "Hello", "max_tokens": 4, "stream": stream}


@pytest.mark.parametrize(("ids", "finish", "stop_id", "text"), CASES)
def test_completion_text_never_ends_in_half_a_character(ids, finish, stop_id, text):
    app, _ = make_app(token_steps(ids, finish, stop_token_id=stop_id))
    response = call(app, "POST", "/v1/completions", json=_body(False))
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [text]
    assert response.json()["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize(("ids", "finish", "stop_id", "text"), CASES)
def test_streamed_deltas_hold_back_and_then_drop_half_a_character(ids, finish, stop_id, text):
    app, _ = make_app(token_steps(ids, finish, stop_token_id=stop_id))
    response = call(app, "POST", "/v1/completions", json=_body(True))
    assert response.status_code == 200, response.text
    chunks = [p for p in sse_payloads(response.text) if p != "[DONE]" and p["choices"]]
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert "".join(deltas) == text
    assert not any(d.endswith("\ufffd") for d in deltas), deltas
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


def test_chat_message_cut_inside_an_emoji_ends_before_it():
    app, _ = make_app(token_steps([*smollm2_tokenizer().encode("Sure"), *GRINNING[:1]], "length"))
    body = {"messages": [{"role": "user", "content": "An emoji?"}], "max_tokens": 2}
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Sure"
