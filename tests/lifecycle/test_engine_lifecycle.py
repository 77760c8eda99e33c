"""The real engine loop on a tiny random model: every path ends with no block in use and
no request in any queue — aborts mid-prefill and mid-decode included."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.tiny_model import tiny_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def assert_idle(llm) -> None:
    engine = llm.engine
    assert engine.num_used_blocks() == 0, f"{engine.num_used_blocks()} blocks still in use"
    assert not engine.scheduler.running, "requests left running"
    assert not engine.scheduler.waiting, "requests left waiting"
    assert not engine.scheduler.requests, "requests left in the scheduler's table"
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir, max_num_batched_tokens=64)


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + 13 * offset) % 40000 + 100 for i in range(length)]


def _run_until(engine, predicate, limit: int = 200) -> None:
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("condition not reached within the step limit")


def test_abort_mid_prefill_frees_every_block(llm):
    engine = llm.engine
    engine.add_request("long", _prompt(300), GREEDY)
    engine.step()  # 64 of 300 prompt tokens computed
    request = engine.scheduler.requests["long"]
    assert 0 < request.num_computed_tokens < 300
    assert engine.num_used_blocks() > 0
    [out] = engine.abort_request(["long"])
    assert out.finished and out.finish_reason == "abort"
    assert_idle(llm)


def test_abort_mid_decode_frees_every_block(llm):
    engine = llm.engine
    engine.add_request("a", _prompt(40), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    _run_until(engine, lambda: len(engine.scheduler.requests["a"].output_token_ids) >= 3)
    engine.abort_request(["a"])
    assert_idle(llm)


def test_abort_while_waiting_and_unknown_ids_are_harmless(llm):
    engine = llm.engine
    engine.add_request("w", _prompt(20), GREEDY)
    engine.abort_request(["w", "never-added"])
    assert_idle(llm)


def test_abort_of_n_best_request_ends_deferred_siblings(llm):
    engine = llm.engine
    engine.add_request("n3", _prompt(100), SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # sibling completions still wait for the first prompt
    [out] = engine.abort_request(["n3"])
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort", "abort"]
    assert_idle(llm)


def test_mixed_lengths_in_one_batch_equal_one_at_a_time(llm):
    prompts = [_prompt(n, offset=n) for n in (1, 2, 7, 16, 17, 63, 64, 65, 200, 450)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert together == alone
    assert_idle(llm)


def test_preemption_recomputes_to_the_same_tokens(tiny_model_dir, llm):
    prompts = [_prompt(60 + 10 * i, offset=i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    # 16 blocks x 16 tokens: room for about two of these requests at a time.
    small = tiny_llm(tiny_model_dir, num_gpu_blocks_override=16, max_model_len=256)
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert got == expected
    assert_idle(small)


def test_n_completions_share_the_prompt_blocks(llm):
    engine = llm.engine
    hits_before = engine.scheduler.stats.prefix_cache_hits
    [out] = llm.generate([_prompt(100, offset=3)], SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids
    # Siblings 1 and 2 each find the 6 full blocks (96 tokens) of the prompt in the cache.
    assert engine.scheduler.stats.prefix_cache_hits - hits_before >= 2 * 96
    assert_idle(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([_prompt(30)], seeded)[0].token_ids
    in_batch = llm.generate([_prompt(50, 1), _prompt(30), _prompt(9, 2)],
                            [SamplingParams(temperature=1.0, max_tokens=10), seeded, GREEDY])[1].token_ids
    other_seed = llm.generate([_prompt(30)], SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    assert alone == in_batch
    assert other_seed[0].token_ids != alone
    assert_idle(llm)


def test_stop_string_truncates_text_and_ends_request(llm):
    free_run = llm.generate([_prompt(20, 4)], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    text = free_run.text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert stop and stop in text
    cut = text.index(stop)
    out = llm.generate([_prompt(20, 4)], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.text == text[:cut]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    kept = llm.generate([_prompt(20, 4)], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == text[: cut + len(stop)]
    assert_idle(llm)


def test_stop_token_id_reports_it_as_stop_reason(llm):
    free_run = llm.generate([_prompt(25, 5)], GREEDY)[0]
    stop_id = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_id)
    out = llm.generate([_prompt(25, 5)], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)
    assert_idle(llm)


def test_request_reaching_max_model_len_finishes_with_length(tiny_model_dir):
    short = tiny_llm(tiny_model_dir, max_model_len=64, num_gpu_blocks_override=8)
    out = short.generate([_prompt(60)], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    assert_idle(short)


def test_too_long_request_is_rejected_with_vllm_message(llm):
    with pytest.raises(ValueError, match=r"This model's maximum context length is 512 tokens\. "
                       r"However, you requested 600 tokens \(500 in the messages, 100 in the completion\)"):
        llm.generate([_prompt(500)], SamplingParams(max_tokens=100))
    assert_idle(llm)


def test_engine_refuses_to_start_when_one_request_cannot_fit(tiny_model_dir):
    with pytest.raises(ValueError, match=r"KV cache too small: 4 blocks x 16 = 64 tokens .* "
                       r"max_model_len=512 tokens, which needs 32 blocks"):
        tiny_llm(tiny_model_dir, num_gpu_blocks_override=4, max_model_len=512)


def test_fp8_kv_cache_serves_requests(tiny_model_dir):
    fp8 = tiny_llm(tiny_model_dir, kv_cache_dtype="fp8")
    out = fp8.generate([_prompt(40)], GREEDY)[0]
    assert len(out.token_ids) == 12
    assert fp8.engine.runner.kv_caches[0].dtype.itemsize == 1
    assert_idle(fp8)


def test_capacity_log_line_reports_blocks_tokens_and_concurrency(tiny_model_dir, caplog):
    caplog.set_level("INFO", logger="engine.core")
    # tiny model: 2 layers x 2 kv heads x 16 dims x 2 (K,V) x 4 bytes = 512 bytes/token.
    tiny_llm(tiny_model_dir, num_gpu_blocks_override=None, kv_cache_memory=1 << 20, max_model_len=256)
    assert "KV cache: 128 blocks x 16 = 2,048 tokens (512 B/token); " \
           "max concurrency at 256 tokens/request: 8.0x" in caplog.text


def test_engine_counts_busy_seconds_per_phase_while_it_steps(llm):
    core = llm.engine.core
    before = core.stats()
    llm.engine.add_request("busy", _prompt(100, offset=9), SamplingParams(temperature=0.0, max_tokens=5,
                                                                           ignore_eos=True))
    _run_until(llm.engine, lambda: "busy" not in llm.engine.scheduler.requests)
    after = core.stats()
    assert after.prompt_tokens - before.prompt_tokens == 100
    assert after.generation_tokens - before.generation_tokens == 5
    assert after.prefill_busy_s > before.prefill_busy_s
    assert after.decode_busy_s > before.decode_busy_s
    assert_idle(llm)
