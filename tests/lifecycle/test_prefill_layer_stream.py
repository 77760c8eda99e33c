"""The prefill worker's layer-by-layer sends (prefill_worker/layer_stream.py) on the real
PrefillWorker and DecodeWorker with the tiny model: the KV that lands on the decode worker is
exactly the one-shot path's, a chunked prompt streams only during its last chunk, and a step
that fails mid-stream fails only that prefill (the decode worker keeps its ticket for the retry)
with no block left anywhere."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_worker.worker import DecodeState
from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from kv_transfer.local import LocalSender
from kv_transfer.packing import pack_blocks
from prefill_worker.worker import PrefillAborted
from tests.lifecycle.pd_pair import assert_idle, make_pair, prompt, record_of
from tests.tiny_model import tiny_llm

S = DecodeState
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
P = prompt(70, 11)  # 5 blocks of 16


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return list(tiny_llm(tiny_model_dir).generate([list(P)], PARAMS)[0].token_ids)


@pytest.fixture()
def calls(monkeypatch):
    """How many transfers went layer by layer and how many whole."""
    counted = {"layers": 0, "whole": 0}
    send, send_layers = LocalSender.send, LocalSender.send_layers

    def whole(self, header, payload):
        counted["whole"] += 1
        return send(self, header, payload)

    def layers(self, feed):
        counted["layers"] += 1
        return send_layers(self, feed)

    monkeypatch.setattr(LocalSender, "send", whole)
    monkeypatch.setattr(LocalSender, "send_layers", layers)
    return counted


def _idle(pair) -> None:
    assert_idle(pair.decode)
    assert_idle(pair.prefill)
    assert pair.decode.importer.open_landings == 0


def _run_one(pair):
    """One request through the pair: (tokens, the KV of its blocks on the decode worker once it
    ended: the prompt's, as received, plus the generated tokens')."""
    landed = []

    async def run():
        ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
        record = record_of(pair.decode, "r")
        first = await pair.prefill.prefill("r", P, PARAMS, pair.target(ticket))
        tokens = [first.first_token_id]
        while True:
            item = await asyncio.wait_for(outputs.get(), 30)
            tokens += item.new_token_ids
            if item.finish_reason is not None:  # freed, not reused: nothing else runs here
                landed.append(pack_blocks(pair.decode.core.kv_caches, record.block_ids))
                return tokens

    tokens = asyncio.run(run())
    return tokens, landed[0]


@pytest.mark.parametrize("engine", [  # the whole prompt in one step; in 3 chunks by budget or as a long prompt
    {"max_num_batched_tokens": 512}, {"max_num_batched_tokens": 32}, {"long_prefill_token_threshold": 24}],
    ids=["one-step", "budget-chunks", "long-prompt-chunks"])
def test_layer_streamed_kv_equals_the_one_shot_kv_exactly(tiny_model_dir, offline, calls, engine):
    results = {}
    for streamed in (True, False):
        pair = make_pair(tiny_model_dir, stream_layers=streamed, **engine)
        try:
            results[streamed] = _run_one(pair)
            _idle(pair)
        finally:
            pair.stop()
    assert calls == {"layers": 1, "whole": 1}
    (tokens_streamed, kv_streamed), (tokens_whole, kv_whole) = results[True], results[False]
    assert tokens_streamed == tokens_whole == offline
    assert kv_streamed.shape[2] == 5 and torch.equal(kv_streamed, kv_whole)


def test_a_step_failing_mid_stream_fails_the_prefill_and_a_retry_fills_the_same_ticket(
        tiny_model_dir, offline, calls):
    pair = make_pair(tiny_model_dir)
    failures = []

    def fail_once_after_layer_one(_module, _args, _out):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected failure after layer 1")

    hook = pair.prefill.core.runner.model.model.layers[1].register_forward_hook(fail_once_after_layer_one)
    try:
        async def run():
            ticket, outputs = await pair.decode.admit("r", P, PARAMS, 60.0)
            record = record_of(pair.decode, "r")
            with pytest.raises(PrefillAborted, match="was aborted before its first token"):
                await pair.prefill.prefill("r", P, PARAMS, pair.target(ticket))
            assert await asyncio.to_thread(wait_until, lambda: pair.decode.status().transfers.failures == 1, 10)
            assert (record.state, pair.decode.in_flight) == (S.TICKETED, 1)
            assert await asyncio.to_thread(wait_until, lambda: pair.decode.status().core.reserved_blocks == 5, 5)
            first = await pair.prefill.prefill("r", P, PARAMS, pair.target(ticket))  # the retry
            tokens = [first.first_token_id]
            while True:
                item = await asyncio.wait_for(outputs.get(), 30)
                tokens += item.new_token_ids
                if item.finish_reason is not None:
                    return record, tokens

        record, tokens = asyncio.run(run())
        assert record.history == [S.TICKETED, S.DECODING, S.FINISHED]
        assert tokens == offline
        assert calls == {"layers": 2, "whole": 0}
        _idle(pair)
    finally:
        hook.remove()
        pair.stop()
