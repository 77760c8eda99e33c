"""Block pressure inside an engine: preemption by recompute, or swap to host memory
(`swap_space`), never an error to the client. Greedy tokens under pressure equal an
unpressured run, colocated and for decode-worker requests whose prompt KV came from a
separate prefill core; every test ends with no block in use (device or swap) and no
request in any queue."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader.locate import default_model_path
from engine.request import Request, RequestStatus
from engine.runner import copy_blocks
from kv_transfer.packing import pack_blocks, unpack_blocks
from tests.tiny_model import tiny_llm

BLOCK = 16
# Tiny model, float32: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes x 16 tokens.
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BLOCK
PRESSURE = dict(num_gpu_blocks_override=16, max_model_len=256)
"""16 blocks x 16 tokens: room for about two of the requests below at a time."""


def swap_gib(num_blocks: int) -> float:
    """swap_space (GiB) that holds exactly `num_blocks` of the tiny model's blocks."""
    return num_blocks * BYTES_PER_BLOCK / 2**30


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + 13 * offset) % 40000 + 100 for i in range(length)]


PROMPTS = [_prompt(60 + 10 * i, offset=i) for i in range(8)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def assert_core_idle(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.free_blocks == stats.total_blocks, "device blocks still in use"
    assert stats.swap_blocks_used == 0, "swap blocks still in use"
    assert (stats.num_running, stats.num_waiting, stats.num_reserved, stats.num_swapped) == (0, 0, 0, 0)
    assert not core.scheduler.requests, "requests left in the scheduler's table"
    assert not core.has_work


@pytest.fixture(scope="module")
def unpressured(tiny_model_dir):
    """A colocated engine with room for everything (256 blocks): never preempts."""
    return tiny_llm(tiny_model_dir)


def unpressured_tokens(llm, prompts) -> list[list[int]]:
    outputs = [list(o.token_ids) for o in llm.generate(prompts, PARAMS)]
    assert llm.engine.scheduler.stats.num_preemptions == 0
    return outputs


@pytest.fixture(scope="module")
def expected(unpressured):
    return unpressured_tokens(unpressured, PROMPTS)


# ---------------------------------------------------------------- the copies
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_copy_blocks_moves_exactly_the_listed_blocks_of_every_layer(dtype):
    shape = (2, 5, BLOCK, 2, 4)  # [K/V, blocks, block_size, kv_heads, head_dim]
    device = [torch.randn(shape).to(dtype) for _ in range(2)]
    host = [torch.zeros(shape).to(dtype) for _ in range(2)]
    copy_blocks(device, host, [(3, 0), (1, 4)])
    for src, dst in zip(device, host):
        assert torch.equal(dst[:, 0].view(torch.uint8), src[:, 3].view(torch.uint8))
        assert torch.equal(dst[:, 4].view(torch.uint8), src[:, 1].view(torch.uint8))
        assert not dst[:, 1:4].view(torch.uint8).any()  # untouched
    back = [torch.zeros(shape).to(dtype) for _ in range(2)]
    copy_blocks(host, back, [(4, 2)])
    assert all(torch.equal(b[:, 2].view(torch.uint8), d[:, 1].view(torch.uint8)) for b, d in zip(back, device))


# ------------------------------------------------------------------ colocated
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_swap_under_pressure_gives_the_same_tokens_as_an_unpressured_run(
    tiny_model_dir, expected, prefix_caching
):
    # With prefix caching, blocks still resident at swap-in are reused instead of copied;
    # without it, every block goes out to host memory and back.
    llm = tiny_llm(tiny_model_dir, swap_space=swap_gib(64), enable_prefix_caching=prefix_caching,
                   **PRESSURE)
    assert llm.engine.core.stats().swap_blocks_total == 64
    got = [list(o.token_ids) for o in llm.generate(PROMPTS, PARAMS)]
    stats = llm.engine.core.stats()
    assert got == expected
    # Every preemption was a swap (the pool always had room), and every swap came back.
    assert (stats.num_preemptions, stats.num_swapped_out, stats.num_swapped_in) == (3, 3, 3)
    assert_core_idle(llm.engine.core)


def test_a_swap_pool_too_small_falls_back_to_recompute_with_the_same_tokens(tiny_model_dir, expected):
    llm = tiny_llm(tiny_model_dir, swap_space=swap_gib(6), **PRESSURE)
    got = [list(o.token_ids) for o in llm.generate(PROMPTS, PARAMS)]
    stats = llm.engine.core.stats()
    assert got == expected
    # One victim fitted in the 6 swap blocks; the two others did not and were recomputed.
    assert (stats.num_preemptions, stats.num_swapped_out, stats.num_swapped_in) == (3, 1, 1)
    assert stats.swap_blocks_total == 6
    assert_core_idle(llm.engine.core)


def test_abort_of_a_swapped_out_request_frees_its_swap_blocks(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, swap_space=swap_gib(64), **PRESSURE)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, PARAMS)
    for _ in range(200):
        if engine.scheduler.swapped:
            break
        engine.step()
    [victim] = engine.scheduler.swapped
    assert victim.status is RequestStatus.SWAPPED
    swap_ids = engine.scheduler.swap.blocks_of(victim.request_id)
    assert len(swap_ids) == engine.kv.num_blocks_for(victim.num_computed_tokens) > 0
    assert engine.core.stats().swap_blocks_used == len(swap_ids)
    [out] = engine.abort_request([victim.request_id])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.core.stats().swap_blocks_used == 0
    assert not engine.scheduler.swapped
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    engine.step()  # drains the finished ids
    assert_core_idle(engine.core)


# ------------------------------------------------------------ decode worker
def _core_config(tiny_model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), tokenizer=str(default_model_path()),
                        dtype="float32", num_threads=1, **overrides)


@pytest.fixture(scope="module")
def prefill_core(tiny_model_dir):
    config = _core_config(tiny_model_dir, max_model_len=512, num_gpu_blocks_override=64)
    return EngineCore(config, hold_finished_blocks=True)


def _decode_core(tiny_model_dir, swap_blocks: int) -> EngineCore:
    return EngineCore(_core_config(tiny_model_dir, swap_space=swap_gib(swap_blocks), **PRESSURE))


def _prefill_remote(prefill: EngineCore, decode: EngineCore, request_id: str, prompt) -> int:
    """Reserve on `decode`, prefill on `prefill`, copy the KV over, commit; the first token."""
    reservation = decode.reserve_remote(Request(request_id, tuple(prompt), PARAMS))
    assert reservation is not None, f"{request_id} could not reserve its prompt blocks"
    return _fill_and_commit(prefill, decode, request_id, prompt, reservation)


def _fill_and_commit(prefill: EngineCore, decode: EngineCore, request_id: str, prompt, reservation) -> int:
    prefill.add_request(Request(request_id, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=1)))
    first = None
    for _ in range(50):
        for out in prefill.step():
            first = out.new_token_ids[0]
        if first is not None:
            break
    assert first is not None
    first_block = reservation.num_cached_tokens // BLOCK
    payload = pack_blocks(prefill.kv_caches, prefill.held_block_ids(request_id)[first_block:])
    prefill.release_blocks(request_id)
    unpack_blocks(payload, decode.kv_caches, reservation.block_ids)
    assert decode.commit_remote(request_id, first) is None
    return first


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "swap"])
def test_remote_requests_under_pressure_give_the_colocated_tokens(
    tiny_model_dir, prefill_core, expected, swap_blocks
):
    decode = _decode_core(tiny_model_dir, swap_blocks)
    indices = (0, 1, 2)  # 60, 70, 80 prompt tokens: 14 blocks reserved; 22 needed at the end
    tokens: dict[str, list[int]] = {}
    for i in indices:
        rid = f"remote{i}"
        tokens[rid] = [_prefill_remote(prefill_core, decode, rid, PROMPTS[i])]
        # One decode step between arrivals, as a live decode worker interleaves them.
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    for _ in range(500):
        if not decode.has_work:
            break
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert [tokens[f"remote{i}"] for i in indices] == [expected[i] for i in indices]
    stats = decode.stats()
    swaps = 1 if swap_blocks else 0
    assert (stats.num_preemptions, stats.num_swapped_out, stats.num_swapped_in) == (1, swaps, swaps)
    assert stats.swap_blocks_total == swap_blocks
    decode.step()  # drains the finished ids
    assert_core_idle(decode)
    assert prefill_core.stats().free_blocks == prefill_core.stats().total_blocks


def test_a_request_that_swaps_itself_out_with_nothing_else_to_run_keeps_its_kv(
    tiny_model_dir, prefill_core, unpressured
):
    """The plan of that step computes nothing but still carries the copy out."""
    long_prompt = _prompt(150, offset=9)
    expected_a, expected_b = unpressured_tokens(unpressured, [PROMPTS[0], long_prompt])
    decode = _decode_core(tiny_model_dir, 64)
    tokens = {"a": [_prefill_remote(prefill_core, decode, "a", PROMPTS[0])]}  # 4 blocks
    reservation = decode.reserve_remote(Request("b", tuple(long_prompt), PARAMS))
    assert reservation is not None and len(reservation.block_ids) == 10  # 2 blocks left
    for _ in range(100):
        if decode.scheduler.swapped:
            break
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    # a filled its 6 blocks (96 tokens) and needed a 7th: it is the only running request.
    [a] = decode.scheduler.swapped
    assert (a.request_id, a.num_computed_tokens) == ("a", 96)
    assert decode.scheduler.swap.blocks_of("a") == (0, 1, 2, 3, 4, 5)
    assert decode.reserve_remote(Request("c", tuple(PROMPTS[1]), PARAMS)) is None  # a resumes first
    decode.step()  # nothing to run while b's KV is on its way
    tokens["b"] = [_fill_and_commit(prefill_core, decode, "b", long_prompt, reservation)]
    for _ in range(500):
        if not decode.has_work:
            break
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert (tokens["a"], tokens["b"]) == (expected_a, expected_b)
    stats = decode.stats()
    assert (stats.num_preemptions, stats.num_swapped_out, stats.num_swapped_in) == (1, 1, 1)
    decode.step()  # drains the finished ids
    assert_core_idle(decode)
