"""Scheduler driven by hand: schedule() -> a runner result built from plain dicts -> update().

The stand-in runner samples, for each request whose chunk ends its known tokens, the token
`1000 + position` (the position of the token being sampled), unless a test scripts the
tokens per request. Every test that runs requests ends with `assert_idle`: no block in
use, no request in any queue.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import pytest

from engine.kv_cache.hashing import ROOT_HASH, hash_block
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.swap_pool import SwapPool
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import (
    EngineCoreOutput,
    RunnerOutput,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 16,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    enable_caching: bool = True,
    num_swap_blocks: int = 0,
    long_prefill_token_threshold: int = 0,
    max_long_partial_prefills: int = 1,
) -> Scheduler:
    """max_model_len defaults to 64 tokens, or what the pool holds if that is less."""
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
    if max_model_len is None:
        max_model_len = min(64, num_blocks * BLOCK_SIZE)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len,
                     swap=SwapPool(num_swap_blocks), long_prefill_token_threshold=long_prefill_token_threshold,
                     max_long_partial_prefills=max_long_partial_prefills)


def test_scheduler_refuses_a_pool_that_cannot_hold_one_max_model_len_request():
    with pytest.raises(ValueError, match=r"3 KV blocks cannot hold one request of max_model_len=64"):
        Scheduler(KVCacheManager(3, BLOCK_SIZE), 8, 64, 64)


def make_request(
    request_id: str, tokens: Iterable[int], *, eos: Iterable[int] = (), **params
) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(request_id, tuple(tokens), SamplingParams(**params), eos_token_ids=frozenset(eos))


def position_token(work: ScheduledRequest) -> int:
    return 1000 + work.start_position + len(work.token_ids)


def scripted(tokens: dict[str, list[int]]) -> Callable[[ScheduledRequest], int]:
    remaining = {rid: list(seq) for rid, seq in tokens.items()}
    return lambda work: remaining[work.request_id].pop(0)


def step(
    sched: Scheduler, sample: Callable[[ScheduledRequest], int] = position_token
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    plan = sched.schedule()
    result = RunnerOutput({w.request_id: sample(w) for w in plan.scheduled if w.sample})
    return plan, sched.update(plan, result)


def run_until_done(
    sched: Scheduler, sample: Callable[[ScheduledRequest], int] = position_token, max_steps: int = 100
) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished:
            sched.schedule()  # drains finished_ids
            return outputs
        for out in step(sched, sample)[1]:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def summary(plan: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start position, number of tokens) of each scheduled request."""
    return [(w.request_id, w.start_position, len(w.token_ids)) for w in plan.scheduled]


def assert_idle(sched: Scheduler) -> None:
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert [b.block_id for b in sched.kv.pool.blocks if b.ref_cnt] == []
    assert list(sched.waiting) == []
    assert sched.running == []
    assert list(sched.swapped) == []
    assert sched.swap.num_used_blocks == 0
    assert sched.requests == {}
    assert sched.has_unfinished is False


# --------------------------------------------------------------- admission
def test_requests_are_admitted_in_arrival_order_with_consecutive_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(10, 15), max_tokens=2))  # 5 tokens -> 2 blocks
    sched.add_request(make_request("b", range(20, 23), max_tokens=2))  # 3 tokens -> 1 block
    sched.add_request(make_request("c", range(30, 36), max_tokens=2))  # 6 tokens -> 2 blocks
    plan = sched.schedule()
    assert summary(plan) == [("a", 0, 5), ("b", 0, 3), ("c", 0, 6)]
    assert [w.block_ids for w in plan.scheduled] == [(0, 1), (2,), (3, 4)]
    assert [w.token_ids for w in plan.scheduled] == [
        (10, 11, 12, 13, 14), (20, 21, 22), (30, 31, 32, 33, 34, 35),
    ]
    assert [w.sample for w in plan.scheduled] == [True, True, True]
    assert plan.num_batched_tokens == 14
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    result = RunnerOutput({w.request_id: position_token(w) for w in plan.scheduled})
    sched.update(plan, result)
    outputs = run_until_done(sched)
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == {
        "a": [1006], "b": [1004], "c": [1007],
    }
    assert_idle(sched)


def test_head_of_the_queue_that_does_not_fit_is_not_overtaken():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", range(10, 22), max_tokens=1))  # 3 blocks
    sched.add_request(make_request("b", range(30, 38), max_tokens=1))  # 2 blocks: only 1 free
    sched.add_request(make_request("c", range(40, 43), max_tokens=1))  # 1 block: would fit
    plan, outputs = step(sched)
    assert summary(plan) == [("a", 0, 12)]
    assert [w.block_ids for w in plan.scheduled] == [(0, 1, 2)]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", (1012,), "length"),
    ]
    # a's blocks were freed last-first: the free queue is 3, 2, 1, 0.
    plan, _ = step(sched)
    assert plan.finished_ids == ("a",)
    assert summary(plan) == [("b", 0, 8), ("c", 0, 3)]
    assert [w.block_ids for w in plan.scheduled] == [(2, 3), (1,)]  # the queue's 3, 2: by id
    run_until_done(sched)
    assert_idle(sched)


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    for rid, base in (("a", 10), ("b", 20), ("c", 30)):
        sched.add_request(make_request(rid, range(base, base + 3), max_tokens=2))
    plans = []
    while sched.has_unfinished:
        plan, _ = step(sched)
        plans.append(summary(plan))
    assert plans == [
        [("a", 0, 3), ("b", 0, 3)],
        [("a", 3, 1), ("b", 3, 1)],
        [("c", 0, 3)],
        [("c", 3, 1)],
    ]
    sched.schedule()
    assert_idle(sched)


def test_finished_ids_are_reported_once_in_the_next_plan():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(10, 13), max_tokens=1))
    plan, outputs = step(sched)
    assert plan.finished_ids == ()
    assert [o.finish_reason for o in outputs] == ["length"]
    plan = sched.schedule()
    assert plan.finished_ids == ("a",)
    assert plan.is_empty and plan.num_batched_tokens == 0
    assert sched.schedule().finished_ids == ()
    assert_idle(sched)


# ---------------------------------------------------------- chunked prefill
def test_token_budget_splits_a_long_prompt_into_chunks():
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 120))  # 20 tokens
    sched.add_request(make_request("a", prompt, max_tokens=2))
    steps = []
    while sched.has_unfinished:
        plan, outputs = step(sched)
        (work,) = plan.scheduled
        steps.append((work.start_position, work.token_ids, work.block_ids, work.sample,
                      [o.new_token_ids for o in outputs]))
    assert steps == [
        (0, tuple(prompt[0:8]), (0, 1), False, []),
        (8, tuple(prompt[8:16]), (0, 1, 2, 3), False, []),
        (16, tuple(prompt[16:20]), (0, 1, 2, 3, 4), True, [(1020,)]),
        (20, (1020,), (0, 1, 2, 3, 4, 5), True, [(1021,)]),
    ]
    sched.schedule()
    assert_idle(sched)


def test_a_chunked_prompt_uses_the_whole_budget_before_the_next_prompt_starts():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", range(100, 112), max_tokens=2))  # 12 tokens
    sched.add_request(make_request("b", range(200, 203), max_tokens=2))  # 3 tokens
    plans = []
    while sched.has_unfinished:
        plan, _ = step(sched)
        plans.append((summary(plan), plan.num_batched_tokens))
    assert plans == [
        ([("a", 0, 8)], 8),
        ([("a", 8, 4), ("b", 0, 3)], 7),
        ([("a", 12, 1), ("b", 3, 1)], 2),
    ]
    sched.schedule()
    assert_idle(sched)


def test_decodes_are_scheduled_before_new_prefills_which_get_the_rest_of_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", range(100, 104), max_tokens=3))
    step(sched)
    sched.add_request(make_request("b", range(200, 210), max_tokens=1))  # 10 tokens
    plan, _ = step(sched)
    assert summary(plan) == [("a", 4, 1), ("b", 0, 7)]
    assert plan.num_batched_tokens == 8
    assert plan.scheduled[0].token_ids == (1004,)
    plan, _ = step(sched)
    assert summary(plan) == [("a", 5, 1), ("b", 7, 3)]
    run_until_done(sched)
    assert_idle(sched)


# ------------------------------------------------------- long prompts (vLLM's flags)
def test_a_long_prompt_is_computed_in_chunks_of_the_threshold_and_short_ones_share_the_step():
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    sched.add_request(make_request("long", range(100, 114), max_tokens=2))  # 14 tokens: long
    sched.add_request(make_request("short", range(200, 205), max_tokens=2))  # 5 tokens: short
    plans = []
    while sched.has_unfinished:
        plans.append(summary(step(sched)[0]))
    assert plans == [
        [("long", 0, 6), ("short", 0, 5)],
        [("long", 6, 6), ("short", 5, 1)],
        [("long", 12, 2)],
        [("long", 14, 1)],  # decodes are never capped
    ]
    sched.schedule()
    assert_idle(sched)


def test_short_prompts_go_ahead_of_a_second_long_one_while_one_long_prompt_is_computed():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=8, max_model_len=64, long_prefill_token_threshold=4)
    sched.add_request(make_request("long1", range(100, 112), max_tokens=1))
    sched.add_request(make_request("long2", range(200, 212), max_tokens=1))
    sched.add_request(make_request("short1", range(300, 303), max_tokens=1))
    sched.add_request(make_request("short2", range(400, 403), max_tokens=1))
    first = summary(step(sched)[0])
    # long1 takes 4 tokens; long2 may not start (one long prompt at a time), so the shorts go
    # ahead of it, in their order, in what is left of the budget.
    assert first == [("long1", 0, 4), ("short1", 0, 3), ("short2", 0, 1)]
    assert [r.request_id for r in sched.waiting] == ["long2"]
    second = summary(step(sched)[0])
    assert second == [("long1", 4, 4), ("short2", 1, 2)]  # long2 waits: long1 is not done
    # long1's last chunk: it will be done, so long2 starts in the same step
    assert summary(step(sched)[0]) == [("long1", 8, 4), ("long2", 0, 4)]
    assert sorted(run_until_done(sched)) == ["long2"]  # the others ended in the steps above
    assert_idle(sched)


def test_with_two_long_prefills_allowed_the_second_long_prompt_starts_at_once():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=8, max_model_len=64, long_prefill_token_threshold=4,
                           max_long_partial_prefills=2)
    sched.add_request(make_request("long1", range(100, 112), max_tokens=1))
    sched.add_request(make_request("long2", range(200, 212), max_tokens=1))
    sched.add_request(make_request("short", range(300, 303), max_tokens=1))
    assert summary(step(sched)[0]) == [("long1", 0, 4), ("long2", 0, 4)]
    run_until_done(sched)
    assert_idle(sched)


def test_only_long_prompts_waiting_behind_the_cap_wait_and_then_run_in_order():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=16, max_model_len=64, long_prefill_token_threshold=4)
    for i, name in enumerate(("a", "b", "c")):
        sched.add_request(make_request(name, range(100 * (i + 1), 100 * (i + 1) + 10), max_tokens=1))
    starts = []
    while sched.has_unfinished:
        for work in step(sched)[0].scheduled:
            if work.start_position == 0:
                starts.append(work.request_id)
    assert starts == ["a", "b", "c"]
    sched.schedule()
    assert_idle(sched)


def test_the_outputs_do_not_depend_on_the_long_prompt_policy():
    prompts = {f"r{i}": list(range(100 * i, 100 * i + n)) for i, n in enumerate((13, 3, 9, 2, 17, 5), start=1)}

    def run(**policy) -> dict[str, list[int]]:
        sched = make_scheduler(num_blocks=48, max_num_batched_tokens=12, max_model_len=64, **policy)
        for rid, prompt in prompts.items():
            sched.add_request(make_request(rid, prompt, max_tokens=3))
        outputs = run_until_done(sched)
        assert_idle(sched)
        return {rid: tokens_of(outs) for rid, outs in outputs.items()}

    assert run(long_prefill_token_threshold=4) == run() == run(long_prefill_token_threshold=4,
                                                              max_long_partial_prefills=3)


# ---------------------------------------------------------------- preemption
def test_running_out_of_blocks_preempts_the_most_recently_admitted_request():
    sched = make_scheduler(num_blocks=3)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=3))  # fills block 0
    sched.add_request(make_request("b", [11, 12, 13], max_tokens=2))
    sched.add_request(make_request("c", [21, 22, 23], max_tokens=2))
    plan, outputs = step(sched)
    assert [w.block_ids for w in plan.scheduled] == [(0,), (1,), (2,)]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [
        ("a", (1004,)), ("b", (1003,)), ("c", (1003,)),
    ]
    c = sched.requests["c"]

    # a's decode needs a second block and none is free: c (admitted last) is preempted.
    plan, outputs = step(sched)
    assert plan.preempted_ids == ("c",)
    assert summary(plan) == [("a", 4, 1), ("b", 3, 1)]
    assert [w.block_ids for w in plan.scheduled] == [(0, 2), (1,)]
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert c.output_token_ids == [1003]
    assert list(sched.waiting) == [c]
    assert sched.stats.num_preemptions == 1
    assert sched.kv.blocks_of("c").block_ids == ()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", (1005,), None), ("b", (1004,), "length"),
    ]

    # b finished; c is recomputed from scratch (prompt + its earlier output) in b's block.
    plan, outputs = step(sched)
    assert plan.finished_ids == ("b",)
    assert summary(plan) == [("a", 5, 1), ("c", 0, 4)]
    assert plan.scheduled[1].token_ids == (21, 22, 23, 1003)
    assert plan.scheduled[1].block_ids == (1,)
    assert plan.scheduled[1].sample is True
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", (1006,), "length"), ("c", (1004,), "length"),
    ]
    assert sched.stats.num_preemptions == 1
    sched.schedule()
    assert_idle(sched)


def test_preempted_request_finishes_with_the_same_outputs_as_an_unpreempted_run():
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = make_scheduler(num_blocks=num_blocks)
        sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=6))
        sched.add_request(make_request("b", [11, 12, 13], max_tokens=6))
        outputs = run_until_done(sched)
        assert_idle(sched)
        return {rid: tokens_of(outs) for rid, outs in outputs.items()}, sched.stats.num_preemptions

    roomy, roomy_preemptions = run(num_blocks=16)
    tight, tight_preemptions = run(num_blocks=3)
    assert roomy_preemptions == 0
    assert tight_preemptions == 1
    assert tight == roomy == {
        "a": [1004, 1005, 1006, 1007, 1008, 1009],
        "b": [1003, 1004, 1005, 1006, 1007, 1008],
    }


def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue():
    sched = make_scheduler(num_blocks=2, max_num_seqs=2)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=2))
    sched.add_request(make_request("b", [11, 12, 13], max_tokens=2))
    sched.add_request(make_request("d", [31, 32, 33], max_tokens=1))  # waits: max_num_seqs
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted_ids == ("b",)
    assert [r.request_id for r in sched.waiting] == ["b", "d"]
    run_until_done(sched)
    assert_idle(sched)


def test_the_newest_request_preempts_itself_when_it_cannot_grow():
    sched = make_scheduler(num_blocks=2)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    sched.add_request(make_request("b", [11, 12, 13, 14], max_tokens=2))  # full block
    step(sched)
    # a's decode fits its block; b needs a second block, and b is the newest.
    plan, _ = step(sched)
    assert summary(plan) == [("a", 3, 1)]
    assert plan.preempted_ids == ("b",)
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    assert sched.stats.num_preemptions == 1
    run_until_done(sched)
    assert_idle(sched)


def test_no_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=5)
    sched.add_request(make_request("g", [1, 2, 3, 4], max_tokens=3))
    sched.add_request(make_request("v", range(100, 111), max_tokens=1))  # 11-token prompt
    plan, _ = step(sched)
    assert summary(plan) == [("g", 0, 4), ("v", 0, 1)]
    assert [w.block_ids for w in plan.scheduled] == [(0,), (1,)]
    # g takes the last free block; v's next chunk needs another, so v preempts itself.
    # Its freed block would hold a 4-token chunk, but a step that preempted admits nothing.
    plan, _ = step(sched)
    assert summary(plan) == [("g", 4, 1)]
    assert plan.preempted_ids == ("v",)
    assert plan.scheduled[0].block_ids == (0, 2)
    assert sched.kv.num_free_blocks == 1
    plan, _ = step(sched)
    assert summary(plan) == [("g", 5, 1), ("v", 0, 4)]
    assert plan.scheduled[1].block_ids == (1,)
    outputs = run_until_done(sched)
    assert tokens_of(outputs["v"]) == [1011]
    assert sched.stats.num_preemptions == 1
    assert_idle(sched)


# ---------------------------------------------------------------------- swap
def test_with_swap_room_the_victims_blocks_are_copied_out_and_back_instead_of_recomputed():
    sched = make_scheduler(num_blocks=3, num_swap_blocks=4)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=3))  # fills block 0
    sched.add_request(make_request("b", [11, 12, 13], max_tokens=2))
    sched.add_request(make_request("c", [21, 22, 23], max_tokens=2))
    step(sched)
    c = sched.requests["c"]

    # a's decode needs a second block: c (admitted last) is swapped out, its block 2 going
    # to swap block 0, and block 2 is handed to a in the same plan (copied out first).
    plan, outputs = step(sched)
    assert plan.preempted_ids == ("c",)
    assert plan.swap_out == ((2, 0),)
    assert plan.swap_in == ()
    assert summary(plan) == [("a", 4, 1), ("b", 3, 1)]
    assert [w.block_ids for w in plan.scheduled] == [(0, 2), (1,)]
    assert c.status is RequestStatus.SWAPPED
    assert c.num_computed_tokens == 3  # kept: nothing is recomputed
    assert sched.swap.blocks_of("c") == (0,)
    assert list(sched.swapped) == [c]
    assert sched.kv.blocks_of("c").block_ids == ()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", (1005,), None), ("b", (1004,), "length"),
    ]

    # b finished: c comes back into b's block 1 and only decodes its next token.
    plan, outputs = step(sched)
    assert plan.swap_in == ((0, 1),)
    assert plan.swap_out == ()
    assert summary(plan) == [("a", 5, 1), ("c", 3, 1)]
    assert plan.scheduled[1].token_ids == (1003,)
    assert plan.scheduled[1].block_ids == (1,)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", (1006,), "length"), ("c", (1004,), "length"),
    ]
    assert (sched.stats.num_preemptions, sched.stats.num_swapped_out, sched.stats.num_swapped_in) == (1, 1, 1)
    sched.schedule()
    assert_idle(sched)


def test_a_swapped_request_resumes_before_a_waiting_request_that_would_fit():
    sched = make_scheduler(num_blocks=4, num_swap_blocks=4)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=8))
    sched.add_request(make_request("c", range(21, 28), max_tokens=4))  # 7 tokens: 2 blocks
    step(sched)
    step(sched)  # a takes the last free block
    sched.add_request(make_request("d", [31, 32, 33], max_tokens=1))
    plan, _ = step(sched)  # c needs a third block: it swaps itself out
    assert plan.preempted_ids == ("c",)
    assert plan.swap_out == ((1, 0), (2, 1))
    # c needs 3 blocks to resume and 2 are free; d needs 1 but must not overtake c.
    for expected_blocks in [(0, 3), (0, 3), (0, 3, 2), (0, 3, 2), (0, 3, 2)]:
        plan, _ = step(sched)
        assert [(w.request_id, w.block_ids) for w in plan.scheduled] == [("a", expected_blocks)]
        assert [r.request_id for r in sched.waiting] == ["d"]
        assert sched.kv.blocks_of("d").block_ids == ()
    # a finished: c resumes first, reusing its first full block still cached in block 1
    # and copying swap block 1 back into block 2; then d is admitted.
    plan, outputs = step(sched)
    assert plan.finished_ids == ("a",)
    assert plan.swap_in == ((1, 2),)
    assert summary(plan) == [("c", 8, 1), ("d", 0, 3)]
    assert [w.block_ids for w in plan.scheduled] == [(1, 2, 3), (0,)]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("c", (1009,)), ("d", (1003,))]
    outputs = run_until_done(sched)
    assert tokens_of(outputs["c"]) == [1010]
    assert_idle(sched)


def test_a_victim_too_big_for_the_free_swap_blocks_is_recomputed():
    sched = make_scheduler(num_blocks=4, num_swap_blocks=1)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=4))
    sched.add_request(make_request("c", range(21, 28), max_tokens=4))  # 2 blocks when preempted
    step(sched)
    step(sched)
    plan, _ = step(sched)
    c = sched.requests["c"]
    assert plan.preempted_ids == ("c",)
    assert plan.swap_out == ()
    assert (c.status, c.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert list(sched.waiting) == [c]
    assert sched.swap.num_used_blocks == 0
    assert (sched.stats.num_preemptions, sched.stats.num_swapped_out) == (1, 0)
    outputs = run_until_done(sched)
    assert tokens_of(outputs["c"]) == [1009, 1010]
    assert_idle(sched)


def test_abort_of_a_swapped_out_request_frees_its_swap_blocks_and_the_queue():
    sched = make_scheduler(num_blocks=3, num_swap_blocks=4)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=3))
    sched.add_request(make_request("b", [11, 12, 13], max_tokens=2))
    sched.add_request(make_request("c", [21, 22, 23], max_tokens=2))
    step(sched)
    step(sched)
    c = sched.requests["c"]
    assert sched.swap.blocks_of("c") == (0,)
    assert sched.abort(["c"]) == [c]
    assert c.status is RequestStatus.FINISHED_ABORTED
    assert (sched.swap.num_used_blocks, list(sched.swapped)) == (0, [])
    outputs = run_until_done(sched)
    assert sorted(outputs) == ["a"]
    assert_idle(sched)


def test_swapped_out_blocks_stay_findable_only_while_resident():
    sched = make_scheduler(num_blocks=4, num_swap_blocks=4)
    sched.add_request(make_request("g", [50, 51, 52, 53], max_tokens=8))
    sched.add_request(make_request("v", range(1, 9), max_tokens=3))  # 2 full blocks
    first, second = (tuple(range(1, 5)), tuple(range(5, 9)))
    h1 = hash_block(ROOT_HASH, first)
    h2 = hash_block(h1, second)
    step(sched)
    plan, _ = step(sched)  # v needs a third block: it swaps itself out
    assert plan.swap_out == ((1, 0), (2, 1))
    # Freed but not reused yet: still resident, so still findable.
    assert [sched.kv.pool.lookup(h).block_id for h in (h1, h2)] == [1, 2]
    for _ in range(4):
        step(sched)  # g grows into block 2, evicting v's second block from the cache
    assert sched.kv.blocks_of("g").block_ids == (0, 3, 2)
    assert sched.kv.pool.lookup(h1).block_id == 1
    assert sched.kv.pool.lookup(h2) is None
    # The swap copy is never a prefix-cache hit: a new request with v's prompt finds block 1 only.
    probe = make_request("probe", [*first, *second, 9], max_tokens=1)
    assert [b.block_id for b in sched.kv.find_prefix(probe).blocks] == [1]
    outputs = run_until_done(sched)
    assert tokens_of(outputs["v"]) == [1009, 1010]
    assert_idle(sched)


def test_a_request_that_swaps_itself_out_alone_yields_a_plan_of_copies_only():
    sched = make_scheduler(num_blocks=4, num_swap_blocks=4)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=6))
    step(sched)
    assert sched.reserve(make_request("r", range(40, 48), max_tokens=2)).block_ids == (1, 2)
    for _ in range(4):
        step(sched)  # a decodes up to 8 tokens in blocks 0 and 3
    plan, outputs = step(sched)  # a needs a third block; the reservation holds the rest
    assert (plan.scheduled, outputs, plan.preempted_ids) == ((), [], ("a",))
    assert plan.is_empty and plan.has_copies
    assert plan.swap_out == ((0, 0), (3, 1))
    assert sched.reserve(make_request("s", [60], max_tokens=1)) is None  # a resumes first
    assert sched.commit("r", 1008) is None
    outputs = run_until_done(sched)
    assert tokens_of(outputs["r"]) == [1009]
    assert tokens_of(outputs["a"]) == [1009]  # its 6th token, decoded after the swap-in
    assert (sched.stats.num_swapped_out, sched.stats.num_swapped_in) == (1, 1)
    assert_idle(sched)


# ------------------------------------------------------------- prefix cache
def test_a_repeated_prompt_reuses_the_cached_blocks_and_computes_only_its_last_token():
    sched = make_scheduler(num_blocks=8)
    prompt = list(range(10, 19))  # 9 tokens: blocks 0, 1 full
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    plan, outputs = step(sched)
    (work,) = plan.scheduled
    assert (work.start_position, work.token_ids, work.block_ids) == (8, (18,), (0, 1, 3))
    assert [(o.new_token_ids, o.num_cached_tokens) for o in outputs] == [((1009,), 8)]
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (18, 8)
    sched.schedule()
    assert_idle(sched)


def test_running_requests_with_a_shared_prefix_hold_the_same_blocks():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", [*range(10, 18), 1], max_tokens=3))
    step(sched)
    sched.add_request(make_request("b", [*range(10, 18), 2], max_tokens=2))
    plan, _ = step(sched)
    assert [(w.request_id, w.block_ids) for w in plan.scheduled] == [
        ("a", (0, 1, 2)), ("b", (0, 1, 3)),
    ]
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:4]] == [2, 2, 1, 1]
    run_until_done(sched)
    assert_idle(sched)


# --------------------------------------------------------------------- abort
def test_abort_between_prefill_chunks_frees_every_block():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", range(100, 110), max_tokens=4))
    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 4)]
    request = sched.requests["a"]
    assert sched.abort(["a"]) == [request]
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert request.finish_reason == "abort"
    assert_idle(sched)
    plan = sched.schedule()
    assert plan.is_empty
    assert plan.finished_ids == ("a",)


def test_abort_mid_decode_frees_every_block_and_empties_every_queue():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(100, 106), max_tokens=8))
    step(sched)
    plan, outputs = step(sched)
    assert summary(plan) == [("a", 6, 1)]
    assert [o.new_token_ids for o in outputs] == [(1007,)]
    assert sched.kv.blocks_of("a").block_ids == (0, 1)
    assert [r.request_id for r in sched.abort(["a"])] == ["a"]
    assert_idle(sched)
    assert sched.schedule().finished_ids == ("a",)


def test_abort_mid_decode_frees_every_block_and_leaves_shared_blocks_to_the_other_request():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", [*range(10, 18), 1], max_tokens=4))
    step(sched)
    sched.add_request(make_request("b", [*range(10, 18), 2], max_tokens=4))
    step(sched)
    step(sched)
    assert sched.kv.blocks_of("b").block_ids == (0, 1, 3)
    sched.abort(["b"])
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:4]] == [1, 1, 1, 0]
    assert [r.request_id for r in sched.running] == ["a"]
    outputs = run_until_done(sched)
    assert tokens_of(outputs["a"]) == [1012]  # a's 4th token; b's blocks stay free
    assert_idle(sched)


def test_update_ignores_results_for_requests_aborted_after_the_plan():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(10, 13), max_tokens=4))
    step(sched)
    request = sched.requests["a"]
    plan = sched.schedule()
    sched.abort(["a"])
    assert sched.update(plan, RunnerOutput({"a": 5})) == []
    assert request.output_token_ids == [1003]
    assert request.num_computed_tokens == 3
    assert_idle(sched)


def test_abort_of_a_waiting_or_preempted_request_removes_it_from_the_queue():
    sched = make_scheduler(num_blocks=2, max_num_seqs=2)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=3))
    sched.add_request(make_request("b", [11, 12, 13], max_tokens=3))
    sched.add_request(make_request("c", [21, 22, 23], max_tokens=3))
    step(sched)
    step(sched)  # a grows: b is preempted
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert [r.request_id for r in sched.abort(["c", "b"])] == ["c", "b"]
    assert list(sched.waiting) == []
    run_until_done(sched)
    assert_idle(sched)


def test_abort_ignores_unknown_and_finished_ids():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(10, 13), max_tokens=1))
    run_until_done(sched)
    assert sched.abort(["a", "nope"]) == []
    assert sched.schedule().finished_ids == ()
    assert_idle(sched)


# ------------------------------------------------------------------- stops
def test_eos_stops_the_request_with_finish_reason_stop_and_no_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], eos=[2], max_tokens=10))
    outputs = run_until_done(sched, scripted({"a": [5, 2, 7]}))
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs["a"]] == [
        ((5,), None, None), ((2,), "stop", None),
    ]
    assert_idle(sched)


def test_ignore_eos_generates_past_eos_until_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], eos=[2], ignore_eos=True, max_tokens=3))
    outputs = run_until_done(sched, scripted({"a": [5, 2, 7]}))
    assert tokens_of(outputs["a"]) == [5, 2, 7]
    assert (outputs["a"][-1].finish_reason, outputs["a"][-1].stop_reason) == ("length", None)
    assert_idle(sched)


def test_stop_token_id_stops_with_that_id_as_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], eos=[2], stop_token_ids=[7], max_tokens=10))
    outputs = run_until_done(sched, scripted({"a": [5, 7, 9]}))
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs["a"]] == [
        ((5,), None, None), ((7,), "stop", 7),
    ]
    assert_idle(sched)


def test_stop_token_ids_still_stop_when_eos_is_ignored():
    sched = make_scheduler()
    sched.add_request(
        make_request("a", [1, 2, 3], eos=[2], ignore_eos=True, stop_token_ids=[7], max_tokens=10)
    )
    outputs = run_until_done(sched, scripted({"a": [2, 7]}))
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs["a"]] == [
        ((2,), None, None), ((7,), "stop", 7),
    ]
    assert_idle(sched)


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    sched = make_scheduler()
    sched.add_request(
        make_request("a", [1, 2, 3], eos=[2], stop_token_ids=[7], min_tokens=3, max_tokens=10)
    )
    outputs = run_until_done(sched, scripted({"a": [2, 7, 5, 2, 9]}))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs["a"]] == [
        ((2,), None), ((7,), None), ((5,), None), ((2,), "stop"),
    ]
    assert_idle(sched)


def test_max_tokens_ends_with_length_even_when_the_last_token_is_eos():
    # vLLM checks the length cap first, so the eos that is also the max_tokens-th token
    # reports "length".
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], eos=[2], max_tokens=2))
    outputs = run_until_done(sched, scripted({"a": [5, 2]}))
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs["a"]] == [
        ((5,), None, None), ((2,), "length", None),
    ]
    assert_idle(sched)


def test_without_max_tokens_the_request_ends_at_max_model_len():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=None))
    outputs = run_until_done(sched)
    assert tokens_of(outputs["a"]) == [1005, 1006, 1007]
    assert outputs["a"][-1].finish_reason == "length"
    assert_idle(sched)


# ---------------------------------------------------------------- add_request
def test_add_request_rejects_prompt_plus_max_tokens_over_max_model_len_with_vllms_message():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError) as info:
        sched.add_request(make_request("a", range(50), max_tokens=20))
    assert str(info.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(50 in the messages, 20 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    assert_idle(sched)


def test_add_request_accepts_prompt_plus_max_tokens_equal_to_max_model_len():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", range(10, 22), max_tokens=4))
    outputs = run_until_done(sched)
    assert tokens_of(outputs["a"]) == [1012, 1013, 1014, 1015]
    assert_idle(sched)


def test_add_request_rejects_an_empty_prompt_and_one_that_fills_max_model_len():
    sched = make_scheduler(max_model_len=8)
    message = r"prompt has {} tokens; it must have between 1 and 7 \(max_model_len=8\)"
    with pytest.raises(ValueError, match=message.format(0)):
        sched.add_request(make_request("a", [], max_tokens=None))
    with pytest.raises(ValueError, match=message.format(8)):
        sched.add_request(make_request("b", range(8), max_tokens=None))
    assert_idle(sched)


def test_add_request_rejects_an_id_already_in_use():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        sched.add_request(make_request("a", [4, 5, 6], max_tokens=1))
    assert sched.requests["a"].prompt_token_ids == (1, 2, 3)
    run_until_done(sched)
    assert_idle(sched)


# ---------------------------------------------------------------- invariants
def assert_block_accounting(sched: Scheduler) -> None:
    """Every block's ref count equals the number of tables holding it; the free queue holds
    exactly the blocks with no reference; each running request's table covers its tokens."""
    holders = [0] * sched.kv.num_blocks
    for rid in sched.requests:  # a finished request holding a block shows up as a mismatch
        for block_id in sched.kv.blocks_of(rid).block_ids:
            holders[block_id] += 1
    assert [b.ref_cnt for b in sched.kv.pool.blocks] == holders
    assert sorted(b.block_id for b in sched.kv.pool.free_queue) == [
        i for i, n in enumerate(holders) if n == 0
    ]
    for request in sched.running:
        assert len(sched.kv.blocks_of(request.request_id)) == sched.kv.num_blocks_for(
            request.num_computed_tokens
        )
    for request in sched.waiting:
        assert sched.kv.blocks_of(request.request_id).block_ids == ()
    swap_holders = [0] * sched.swap.num_blocks
    for request in sched.swapped:
        assert sched.kv.blocks_of(request.request_id).block_ids == ()
        swap_ids = sched.swap.blocks_of(request.request_id)
        assert len(swap_ids) == sched.kv.num_blocks_for(request.num_computed_tokens)
        for swap_id in swap_ids:
            swap_holders[swap_id] += 1
    assert all(n <= 1 for n in swap_holders), "a swap block held twice"
    assert sum(swap_holders) == sched.swap.num_used_blocks


@pytest.mark.parametrize("num_swap_blocks", [0, 5], ids=["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_aborts_keeps_block_accounting_exact_and_outputs_unchanged(
    seed, num_swap_blocks
):
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=12, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=40,
        num_swap_blocks=num_swap_blocks,
    )
    shared = [rng.randrange(1, 50) for _ in range(8)]
    expected: dict[str, list[int]] = {}
    produced: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for i in range(24):
        own = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 14))]
        prompt = shared[: rng.choice((0, 4, 8))] + own  # 0, 1 or 2 full shared blocks
        max_tokens = rng.randrange(1, 10)
        rid = f"r{i}"
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))
        # The stand-in runner samples 1000 + position, so an undisturbed run gives these.
        expected[rid] = [1000 + len(prompt) + k for k in range(max_tokens)]
        for _ in range(rng.randrange(0, 3)):
            plan, outputs = step(sched)
            for out in outputs:
                produced.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert_block_accounting(sched)
        if rng.random() < 0.2 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort([victim])
            aborted.add(victim)
            assert_block_accounting(sched)
    for _ in range(500):
        if not sched.has_unfinished:
            break
        plan, outputs = step(sched)
        for out in outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert_block_accounting(sched)
    sched.schedule()
    assert_idle(sched)
    assert sched.stats.num_preemptions >= 1 and sched.stats.prefix_cache_hits >= 1  # coverage
    assert (sched.stats.num_swapped_out >= 1) == (num_swap_blocks > 0)
    assert sched.stats.num_swapped_in <= sched.stats.num_swapped_out  # the others were aborted
    for rid, tokens in expected.items():
        if rid in aborted:
            assert produced.get(rid, []) == tokens[: len(produced.get(rid, []))]
        else:
            assert produced[rid] == tokens, rid
