"""PromptEncoder (router/serving/prompt_encoder.py): the short prompts that reach it in one pass
of the event loop are encoded in one call, each gets its own ids, and one bad text or a client
that left does not disturb the others."""

from __future__ import annotations

import asyncio

import pytest

from router.serving.prompt_encoder import PromptEncoder
from tests.unit.router_doubles import smollm2_tokenizer


class Recording:
    """The real tokenizer, recording each call; texts in `bad` make a call raise."""

    def __init__(self, bad: frozenset[str] = frozenset()) -> None:
        self.inner, self.bad, self.calls = smollm2_tokenizer(), bad, []

    def encode(self, text, add_special_tokens=True):
        self.calls.append(("encode", (text,), add_special_tokens))
        if text in self.bad:
            raise ValueError(f"cannot encode {text!r}")
        return self.inner.encode(text, add_special_tokens)

    def encode_many(self, texts, add_special_tokens=True):
        self.calls.append(("encode_many", tuple(texts), add_special_tokens))
        if self.bad & set(texts):
            raise ValueError("a bad text in the batch")
        return self.inner.encode_many(texts, add_special_tokens)


TEXTS = ["The capital of France is", "Hello there", "1 2 3 4", "<|im_start|>user\nHi"]


def test_prompts_of_one_loop_pass_are_encoded_in_one_call_each_with_its_own_ids():
    tok = Recording()
    encoder = PromptEncoder(tok)

    async def go():
        return await asyncio.gather(*(encoder.encode(t) for t in TEXTS))

    assert asyncio.run(go()) == [tok.inner.encode(t) for t in TEXTS]
    assert tok.calls == [("encode_many", tuple(TEXTS), True)]


def test_add_special_tokens_splits_the_batch_and_a_later_pass_makes_a_new_call():
    tok = Recording()
    encoder = PromptEncoder(tok)

    async def go():
        together = await asyncio.gather(encoder.encode("a b", True), encoder.encode("c d", False),
                                        encoder.encode("e f", True))
        alone = await encoder.encode("g h")
        return together, alone

    together, alone = asyncio.run(go())
    assert together == [tok.inner.encode("a b", True), tok.inner.encode("c d", False), tok.inner.encode("e f", True)]
    assert alone == tok.inner.encode("g h")
    assert tok.calls == [("encode_many", ("a b", "e f"), True), ("encode_many", ("c d",), False),
                         ("encode_many", ("g h",), True)]


def test_a_bad_text_fails_only_its_own_request():
    tok = Recording(bad=frozenset({"bad"}))
    encoder = PromptEncoder(tok)

    async def go():
        return await asyncio.gather(encoder.encode("good one"), encoder.encode("bad"), encoder.encode("good two"),
                                    return_exceptions=True)

    first, bad, second = asyncio.run(go())
    assert first == tok.inner.encode("good one") and second == tok.inner.encode("good two")
    assert isinstance(bad, ValueError)


def test_a_request_cancelled_while_queued_is_left_out():
    tok = Recording()
    encoder = PromptEncoder(tok)

    async def go():
        gone = asyncio.ensure_future(encoder.encode("gone"))
        kept = asyncio.ensure_future(encoder.encode("kept"))
        await asyncio.sleep(0)  # both queued; the batch runs after this pass
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await kept

    assert asyncio.run(go()) == tok.inner.encode("kept")
    assert tok.calls == [("encode_many", ("kept",), True)]
