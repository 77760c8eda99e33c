"""Prefill on one EngineCore, decode on another: the KV blocks move between them as a
packed payload (in process here; kv_transfer carries the same payload across processes).
Greedy tokens equal the colocated engine's, and both cores end with every block free."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request
from kv_transfer.packing import pack_blocks, unpack_blocks
from engine.sampling_params import SamplingParams
from engine.loader.locate import default_model_path
from tests.tiny_model import tiny_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def cores(tiny_model_dir):
    cfg = dict(model=str(tiny_model_dir), tokenizer=str(default_model_path()), dtype="float32",
               max_model_len=512, num_gpu_blocks_override=64, num_threads=1)
    prefill = EngineCore(EngineConfig(**cfg), hold_finished_blocks=True)
    decode = EngineCore(EngineConfig(**cfg))
    return prefill, decode


def _prompt(length: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((11 * i + 17 * offset) % 40000 + 200 for i in range(length))


def _disaggregated(prefill: EngineCore, decode: EngineCore, request_id: str, prompt, params=PARAMS):
    reservation = decode.reserve_remote(Request(request_id, prompt, params))
    assert reservation is not None
    prefill.add_request(Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    first = None
    for _ in range(50):
        for out in prefill.step():
            first = out.new_token_ids[0]
        if first is not None:
            break
    first_block = reservation.num_cached_tokens // BLOCK
    payload = pack_blocks(prefill.kv_caches, prefill.held_block_ids(request_id)[first_block:])
    assert payload.shape[2] == len(reservation.block_ids)
    prefill.release_blocks(request_id)
    unpack_blocks(payload, decode.kv_caches, reservation.block_ids)
    tokens = [first]
    done = decode.commit_remote(request_id, first)
    while done is None:
        for out in decode.step():
            tokens.extend(out.new_token_ids)
            if out.finish_reason is not None:
                done = out
    return tokens, reservation


def _assert_idle(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.free_blocks == stats.total_blocks
    assert (stats.num_running, stats.num_waiting, stats.num_reserved) == (0, 0, 0)
    assert not core.scheduler.held


def test_disaggregated_greedy_tokens_equal_colocated(cores, tiny_model_dir):
    prefill, decode = cores
    prompts = [_prompt(n, n) for n in (5, 16, 40, 130)]
    colocated = tiny_llm(tiny_model_dir)
    expected = [list(o.token_ids) for o in colocated.generate([list(p) for p in prompts], PARAMS)]
    got = [_disaggregated(prefill, decode, f"r{i}", p)[0] for i, p in enumerate(prompts)]
    assert got == expected
    _assert_idle(prefill)
    _assert_idle(decode)


def test_decode_prefix_hit_means_only_missing_blocks_are_sent(cores, tiny_model_dir):
    prefill, decode = cores
    prompt = _prompt(70, 9)  # 4 full blocks + 6 tokens
    first, _ = _disaggregated(prefill, decode, "warm", prompt)
    again, reservation = _disaggregated(prefill, decode, "hit", prompt)
    assert reservation.num_cached_tokens == 64  # 4 full blocks already on the decode worker
    assert len(reservation.block_ids) == 1  # only the partial last block crosses
    assert again == first
    _assert_idle(prefill)
    _assert_idle(decode)


def test_reservation_is_refused_without_taking_blocks_when_the_pool_is_short(cores):
    _, decode = cores
    assert decode.reserve_remote(Request("a", _prompt(400, 1), PARAMS)) is not None  # 25 blocks
    assert decode.reserve_remote(Request("b", _prompt(400, 2), PARAMS)) is not None  # 25 more
    before = decode.stats().free_blocks
    assert before == 14
    assert decode.reserve_remote(Request("c", _prompt(300, 3), PARAMS)) is None  # needs 19
    assert decode.stats().free_blocks == before
    assert decode.stats().reserved_blocks == 50
    decode.abort(["a", "b"])
    _assert_idle(decode)


def test_abort_of_a_reservation_and_of_a_held_prefill_frees_their_blocks(cores):
    prefill, decode = cores
    assert decode.reserve_remote(Request("gone", _prompt(50, 3), PARAMS)) is not None
    assert decode.stats().reserved_blocks == 4
    decode.abort(["gone"])
    prefill.add_request(Request("held", _prompt(50, 3), SamplingParams(temperature=0.0, max_tokens=1)))
    while "held" not in prefill.scheduler.held:
        prefill.step()
    assert prefill.stats().free_blocks < prefill.stats().total_blocks
    prefill.abort(["held"])
    _assert_idle(prefill)
    _assert_idle(decode)


def test_first_token_that_ends_the_request_finishes_it_at_commit(cores):
    _, decode = cores
    prompt = _prompt(20, 4)
    reservation = decode.reserve_remote(Request("one", prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    assert reservation is not None
    out = decode.commit_remote("one", 123)
    assert out is not None and out.finish_reason == "length"
    _assert_idle(decode)
