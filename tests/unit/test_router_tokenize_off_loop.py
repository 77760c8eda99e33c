"""Tokenizing a large prompt runs beside the event loop, not on it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx

from tests.unit.router_doubles import make_app, token_steps


def test_a_large_prompt_does_not_stall_the_event_loop_while_it_is_tokenized():
    app, backend = make_app(token_steps([1]), max_model_len=1024)
    # Distinct words, so the tokenizer's word cache cannot make it quick: ~0.5 MB, ~120k tokens.
    prompt = " ".join(f"q{i}z" for i in range(60_000))
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            started = time.monotonic()
            task = asyncio.create_task(client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}))
            worst = 0.0
            while not task.done():
                tick = time.monotonic()
                await asyncio.sleep(0.01)
                worst = max(worst, time.monotonic() - tick - 0.01)
            return await task, worst, time.monotonic() - started

    response, worst, took = asyncio.run(go())
    assert response.status_code == 400  # too long for the context, found after tokenizing
    assert "maximum context length is 1024 tokens" in response.json()["error"]["message"]
    assert backend.requests == []
    # On the loop, the loop would stall for the whole tokenization; beside it, for slices.
    assert worst < 0.5 * took, f"the event loop stalled {worst:.2f} s of {took:.2f} s"


def test_a_short_prompt_is_tokenized_on_the_event_loop_without_a_thread_hop():
    app, backend = make_app(token_steps([1]), max_model_len=1024)
    body = json.dumps({"prompt": "Hello world", "max_tokens": 1}).encode()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    before = {t.name for t in threading.enumerate()}
    response = asyncio.run(go())
    threads = [t.name for t in threading.enumerate() if t.name not in before]
    assert response.status_code == 200
    assert [r.prompt_token_ids for r in backend.requests] == [(19556, 905)]
    assert not [name for name in threads if name.startswith("router-tokenize")], threads


def test_small_prompt_and_small_chat_decide_by_size_and_kind():
    from router.api.openai_models import ChatMessage
    from router.serving.service import INLINE_PROMPT_CHARS, small_chat, small_prompt

    assert small_prompt("x" * INLINE_PROMPT_CHARS) is True
    assert small_prompt("x" * (INLINE_PROMPT_CHARS + 1)) is False
    assert small_prompt([1, 2, 3]) is True
    assert small_prompt(["a", "b"]) is False  # a list of prompts: beside the loop
    assert small_chat([ChatMessage(role="user", content="hi")]) is True
    assert small_chat([ChatMessage(role="user", content="x" * (INLINE_PROMPT_CHARS + 1))]) is False
