"""Routing policies on fixed snapshots with a seeded rng: exact choices, reasons and inputs."""

from __future__ import annotations

import random

import pytest

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.cluster.state import fence_incarnations
from router.routing.policy import (
    POLICIES,
    CacheAware,
    CacheAwareWeights,
    LeastLoaded,
    RoundRobin,
    RouteDecision,
    RouteRequest,
    cache_aware,
    least_loaded,
    make_policy,
    prompt_blocks,
    round_robin,
)


def worker(worker_id: str, role: str, **load) -> WorkerInfo:
    values = dict(
        worker_id=worker_id,
        role=role,
        address=f"127.0.0.1:{50000 + len(worker_id)}",
        metrics_address="",
        incarnation="inc-1",
        block_size=16,
        total_blocks=100,
        free_blocks=100,
        reserved_blocks=0,
        cached_blocks=0,
        num_running=0,
        num_waiting=0,
        queued_prefill_tokens=0,
        max_model_len=4096,
        updated_at=1000.0,
    )
    values.update(load)
    return WorkerInfo(**values)


def snapshot(*workers: WorkerInfo) -> ClusterSnapshot:
    return ClusterSnapshot(workers=tuple(workers), taken_at=1.0, stale=False)


REQUEST = RouteRequest(num_prompt_tokens=40, max_tokens=16)  # 3 blocks of 16


def test_prompt_blocks_rounds_up_to_whole_blocks():
    assert [prompt_blocks(n, 16) for n in (0, 1, 16, 17, 40)] == [0, 1, 1, 2, 3]


def test_route_request_rejects_negative_counts():
    with pytest.raises(ValueError, match="num_prompt_tokens must be >= 0; got -1"):
        RouteRequest(num_prompt_tokens=-1, max_tokens=None)
    with pytest.raises(ValueError, match="max_tokens must be >= 0 or None; got -2"):
        RouteRequest(num_prompt_tokens=1, max_tokens=-2)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "cache_aware"])
def test_every_policy_returns_none_without_a_decode_worker(name):
    only_prefill = snapshot(worker("p0", "prefill"))
    assert make_policy(name).choose(REQUEST, only_prefill, random.Random(0)) is None
    assert make_policy(name).choose(REQUEST, snapshot(), random.Random(0)) is None


def test_registry_knows_every_policy_and_lists_them_for_an_unknown_name():
    assert POLICIES.names() == ["cache_aware", "least_loaded", "round_robin"]
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_policy("cache_aware"), CacheAware)
    assert make_policy("cache_aware").weights == CacheAwareWeights(1.0, 0.5)
    with pytest.raises(KeyError) as info:
        make_policy("random")
    assert info.value.args[0] == (
        "unknown routing policy 'random'; known: cache_aware, least_loaded, round_robin"
    )


def test_make_policy_gives_each_caller_its_own_round_robin_counter():
    first, second = make_policy("round_robin"), make_policy("round_robin")
    assert first is not second


def test_round_robin_cycles_each_role_in_worker_id_order():
    snap = snapshot(
        worker("p1", "prefill"), worker("p0", "prefill"),
        worker("d2", "decode"), worker("d0", "decode"), worker("d1", "decode"),
    )  # fmt: skip
    policy, rng = RoundRobin(), random.Random(7)
    pairs = [
        (d.prefill_id, d.decode_id) for d in (policy.choose(REQUEST, snap, rng) for _ in range(4))
    ]
    assert pairs == [("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0")]
    assert policy.turn == 4


def test_round_robin_does_not_advance_when_it_cannot_route():
    policy = RoundRobin(turn=5)
    assert policy.choose(REQUEST, snapshot(), random.Random(0)) is None
    assert policy.turn == 5


def test_round_robin_reports_its_turn_and_candidate_counts():
    snap = snapshot(worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode"))
    assert round_robin(REQUEST, snap, random.Random(0), turn=3) == RouteDecision(
        prefill_id="p0",
        decode_id="d1",
        reason="round_robin: turn 3",
        inputs=(("turn", 3.0), ("prefill_candidates", 1.0), ("decode_candidates", 2.0)),
    )


def test_round_robin_lets_the_decode_worker_prefill_when_no_prefill_worker_exists():
    decision = round_robin(REQUEST, snapshot(worker("d0", "decode")), random.Random(0), turn=0)
    assert (decision.prefill_id, decision.decode_id) == (None, "d0")


def test_least_loaded_prefers_fewest_queued_prefill_tokens_and_most_decode_room():
    snap = snapshot(
        worker("p0", "prefill", queued_prefill_tokens=900, num_running=0),
        worker("p1", "prefill", queued_prefill_tokens=100, num_running=5),
        worker("d0", "decode", free_blocks=50, reserved_blocks=10, num_running=1),
        worker("d1", "decode", free_blocks=60, reserved_blocks=30, num_running=0),
    )
    assert least_loaded(REQUEST, snap, random.Random(0)) == RouteDecision(
        prefill_id="p1",
        decode_id="d0",
        reason="least_loaded: prefill p1, decode d0",
        inputs=(
            ("prompt_blocks", 3.0),
            ("decode_cached_blocks", 0.0),
            ("decode_candidates", 2.0),
            ("decode_headroom_blocks", 37.0),
            ("decode_running", 1.0),
            ("prefill_candidates", 2.0),
            ("prefill_queued_tokens", 100.0),
            ("prefill_running", 5.0),
        ),
    )


def test_least_loaded_counts_the_prompt_in_each_decode_workers_own_block_size():
    # 40 tokens: 3 blocks of 16 on d16 (free 40 -> 37 left), 1 block of 64 on d64 (38 -> 37).
    snap = snapshot(
        worker("d16", "decode", free_blocks=40, num_running=2),
        worker("d64", "decode", free_blocks=38, block_size=64, num_running=1),
    )
    decision = least_loaded(REQUEST, snap, random.Random(0))
    assert decision.decode_id == "d64"  # equal room, fewer running
    assert dict(decision.inputs)["decode_headroom_blocks"] == 37.0
    assert dict(decision.inputs)["prompt_blocks"] == 1.0


def test_least_loaded_breaks_prefill_ties_by_running_then_by_rng():
    by_running = snapshot(
        worker("p0", "prefill", queued_prefill_tokens=10, num_running=2),
        worker("p1", "prefill", queued_prefill_tokens=10, num_running=1),
        worker("d0", "decode"),
    )
    assert least_loaded(REQUEST, by_running, random.Random(0)).prefill_id == "p1"

    full_tie = snapshot(
        worker("p0", "prefill"), worker("p1", "prefill"), worker("p2", "prefill"),
        worker("d0", "decode"),
    )  # fmt: skip
    picks = [least_loaded(REQUEST, full_tie, random.Random(seed)).prefill_id for seed in range(6)]
    assert picks == ["p1", "p0", "p0", "p0", "p0", "p2"]


def test_least_loaded_breaks_decode_ties_by_rng_reproducibly():
    snap = snapshot(worker("d0", "decode"), worker("d1", "decode"))
    rng = random.Random(3)
    picks = [least_loaded(REQUEST, snap, rng).decode_id for _ in range(8)]
    assert picks == ["d0", "d0", "d1", "d1", "d0", "d0", "d1", "d1"]


def test_least_loaded_draws_from_rng_only_on_a_tie():
    snap = snapshot(worker("p0", "prefill", queued_prefill_tokens=5), worker("d0", "decode"))
    rng = random.Random(11)
    state = rng.getstate()
    least_loaded(REQUEST, snap, rng)
    assert rng.getstate() == state


def test_least_loaded_still_picks_the_roomiest_decode_worker_when_none_has_room():
    snap = snapshot(
        worker("d0", "decode", free_blocks=2),
        worker("d1", "decode", free_blocks=1),
    )
    decision = least_loaded(REQUEST, snap, random.Random(0))
    assert decision.decode_id == "d0"
    assert decision.prefill_id is None
    assert decision.reason == (
        "least_loaded: prefill on decode worker, decode d0 (lacks 1 blocks; no decode worker "
        "has room)"
    )


def test_a_worker_with_role_both_may_prefill_for_another_decode_worker():
    snap = snapshot(
        worker("b0", "both", queued_prefill_tokens=0, free_blocks=10),
        worker("d0", "decode", free_blocks=90),
        worker("p0", "prefill", queued_prefill_tokens=300),
    )
    decision = least_loaded(REQUEST, snap, random.Random(0))
    assert (decision.prefill_id, decision.decode_id) == ("b0", "d0")


def test_a_worker_with_role_both_chosen_for_both_prefills_locally():
    snap = snapshot(worker("b0", "both"), worker("p0", "prefill", queued_prefill_tokens=64))
    decision = least_loaded(REQUEST, snap, random.Random(0))
    assert (decision.prefill_id, decision.decode_id) == (None, "b0")
    assert decision.reason == "least_loaded: prefill on decode worker, decode b0"


def test_fence_keeps_the_newest_entry_per_worker_and_sorts_by_id():
    old = worker("d0", "decode", incarnation="a", updated_at=100.0)
    new = worker("d0", "decode", incarnation="b", updated_at=200.0)
    other = worker("c9", "decode", updated_at=50.0)
    kept, fence = fence_incarnations([old, other, new], {})
    assert kept == (other, new)
    assert fence == {"d0": ("b", 200.0), "c9": ("inc-1", 50.0)}


def test_fence_drops_a_late_write_from_a_previous_incarnation():
    late = worker("d0", "decode", incarnation="a", updated_at=150.0)
    kept, fence = fence_incarnations([late], {"d0": ("b", 200.0)})
    assert kept == ()
    assert fence == {"d0": ("b", 200.0)}


def test_fence_accepts_a_restart_with_a_newer_heartbeat():
    restarted = worker("d0", "decode", incarnation="c", updated_at=300.0)
    kept, fence = fence_incarnations([restarted], {"d0": ("b", 200.0)})
    assert kept == (restarted,)
    assert fence == {"d0": ("c", 300.0)}


# ---------------------------------------------------------------------------- cache_aware

LONG = 1008  # 63 blocks of 16


def test_route_request_reports_cached_blocks_per_worker_and_zero_for_the_rest():
    request = RouteRequest(LONG, 8, cached_blocks=(("p0", 60), ("d0", 2)))
    assert [request.cached_for(w) for w in ("p0", "d0", "p1")] == [60, 2, 0]


def test_route_request_rejects_bad_cached_blocks():
    with pytest.raises(ValueError, match="cached_blocks\\['p0'\\] must be an int >= 0; got -1"):
        RouteRequest(LONG, 8, cached_blocks=(("p0", -1),))
    with pytest.raises(ValueError, match="cached_blocks names a worker twice: \\['p0', 'p0'\\]"):
        RouteRequest(LONG, 8, cached_blocks=(("p0", 1), ("p0", 2)))
    with pytest.raises(ValueError, match="held_blocks\\['p0'\\] must be an int >= 0; got True"):
        RouteRequest(LONG, 8, held_blocks=(("p0", True),))
    with pytest.raises(ValueError, match="held_blocks names a worker twice"):
        RouteRequest(LONG, 8, held_blocks=(("p0", 1), ("p0", 2)))


@pytest.mark.parametrize("seed", range(8))
def test_a_prompt_nobody_holds_goes_to_the_idle_prefill_worker_holding_the_fewest_blocks(seed):
    # Equal cost (nothing cached anywhere) and equal running: the rng used to decide, so three
    # new system prompts could all land on one worker and evict each other there.
    snap = snapshot(worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"))
    request = RouteRequest(LONG, 16, held_blocks=(("p0", 10),))
    assert cache_aware(request, snap, random.Random(seed)).prefill_id == "p1"
    fuller = RouteRequest(LONG, 16, held_blocks=(("p0", 10), ("p1", 11)))
    assert cache_aware(fuller, snap, random.Random(seed)).prefill_id == "p0"


def test_fewer_running_still_comes_before_fewer_held_blocks():
    snap = snapshot(worker("p0", "prefill"), worker("p1", "prefill", num_running=1), worker("d0", "decode"))
    request = RouteRequest(LONG, 16, held_blocks=(("p0", 50),))
    assert cache_aware(request, snap, random.Random(0)).prefill_id == "p0"


@pytest.mark.parametrize(
    ("queued", "chosen"), [(0, "p_hot"), (1919, "p_hot"), (1920, "p_idle"), (1921, "p_idle")]
)
def test_the_worker_holding_60_of_63_blocks_wins_over_an_idle_one_until_its_queue_reaches_1920(
    queued, chosen
):
    # hot: 48 tokens to compute + 0.5 x queued; idle: 1008 to compute. At 1920 queued the costs
    # tie and the idle worker wins on fewer running requests.
    snap = snapshot(
        worker("p_hot", "prefill", queued_prefill_tokens=queued, num_running=1),
        worker("p_idle", "prefill"),
        worker("d0", "decode"),
    )
    request = RouteRequest(LONG, 16, cached_blocks=(("p_hot", 60),))
    assert cache_aware(request, snap, random.Random(0)).prefill_id == chosen


def test_cache_aware_explains_its_choice_with_every_number_it_used():
    snap = snapshot(
        worker("p_hot", "prefill", queued_prefill_tokens=100, num_running=2),
        worker("p_idle", "prefill"),
        worker("d0", "decode", free_blocks=80, reserved_blocks=10, num_running=3),
        worker("d1", "decode", free_blocks=60, reserved_blocks=0, num_running=1),
    )
    request = RouteRequest(LONG, 16, cached_blocks=(("p_hot", 60), ("d1", 20)), held_blocks=(("p_hot", 75),))
    assert cache_aware(request, snap, random.Random(0)) == RouteDecision(
        prefill_id="p_hot",
        decode_id="d1",
        reason=(
            "cache_aware: prefill p_hot (lowest cost 98: 60/63 blocks cached, 48 tokens to "
            "compute, 100 queued), decode d1 (most room: 17 blocks left after 43 new, 20 cached)"
        ),
        inputs=(
            ("prompt_tokens", 1008.0),
            ("decode_candidates", 2.0),
            ("decode_prompt_blocks", 63.0),
            ("decode_cached_blocks", 20.0),
            ("decode_needed_blocks", 43.0),
            ("decode_headroom_blocks", 17.0),
            ("decode_running", 1.0),
            ("prefill_candidates", 2.0),
            ("prefill_prompt_blocks", 63.0),
            ("prefill_cached_blocks", 60.0),
            ("prefill_uncached_tokens", 48.0),
            ("prefill_queued_tokens", 100.0),
            ("prefill_running", 2.0),
            ("prefill_held_blocks", 75.0),
            ("prefill_cost", 98.0),
            ("weight_uncached_token", 1.0),
            ("weight_queued_token", 0.5),
        ),
    )


def test_cache_aware_weights_trade_cached_tokens_against_queued_ones():
    snap = snapshot(
        worker("p_hot", "prefill", queued_prefill_tokens=9000),
        worker("p_idle", "prefill"),
        worker("d0", "decode"),
    )
    request = RouteRequest(LONG, 16, cached_blocks=(("p_hot", 60),))
    rng = random.Random(0)
    assert cache_aware(request, snap, rng).prefill_id == "p_idle"  # 9048 vs 1008
    light_queue = CacheAwareWeights(uncached_token=1.0, queued_token=0.1)
    decision = CacheAware(light_queue).choose(request, snap, rng)
    assert decision.prefill_id == "p_hot"  # 48 + 900 = 948 vs 1008
    assert dict(decision.inputs)["prefill_cost"] == 948.0


def test_cache_aware_weights_are_validated():
    with pytest.raises(ValueError, match="queued_token weight must be finite and >= 0; got -1"):
        CacheAwareWeights(queued_token=-1.0)
    with pytest.raises(ValueError, match="uncached_token weight must be finite and >= 0; got inf"):
        CacheAwareWeights(uncached_token=float("inf"))
    with pytest.raises(ValueError, match="at least one cache_aware weight must be > 0"):
        CacheAwareWeights(0.0, 0.0)
    with pytest.raises(ValueError, match="queued_token weight must be a number; got True"):
        CacheAwareWeights(queued_token=True)


def test_cache_aware_picks_the_decode_worker_that_needs_fewer_new_blocks():
    # d_cold must reserve all 63 blocks (free 70 -> 7 left); d_warm holds 60 (free 30 -> 27).
    snap = snapshot(worker("d_cold", "decode", free_blocks=70), worker("d_warm", "decode", free_blocks=30))
    request = RouteRequest(LONG, 16, cached_blocks=(("d_warm", 60),))
    decision = cache_aware(request, snap, random.Random(0))
    assert (decision.prefill_id, decision.decode_id) == (None, "d_warm")
    assert dict(decision.inputs)["decode_headroom_blocks"] == 27.0
    assert decision.reason == (
        "cache_aware: prefill on decode worker, decode d_warm (most room: 27 blocks left "
        "after 3 new, 60 cached)"
    )


def test_cache_aware_counts_cached_tokens_in_the_prefill_workers_own_block_size():
    # p32 holds 30 blocks of 32 = 960 tokens (48 left); p16 holds 40 blocks of 16 (368 left).
    snap = snapshot(
        worker("p16", "prefill"), worker("p32", "prefill", block_size=32), worker("d0", "decode")
    )
    request = RouteRequest(LONG, 16, cached_blocks=(("p16", 40), ("p32", 30)))
    decision = cache_aware(request, snap, random.Random(0))
    assert decision.prefill_id == "p32"
    assert dict(decision.inputs)["prefill_uncached_tokens"] == 48.0
    assert dict(decision.inputs)["prefill_prompt_blocks"] == 32.0


def test_cache_aware_breaks_full_ties_by_rng_reproducibly_and_draws_only_on_a_tie():
    tie = snapshot(worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"))
    request = RouteRequest(LONG, 16)
    picks = [cache_aware(request, tie, random.Random(seed)).prefill_id for seed in range(6)]
    assert picks == ["p1", "p0", "p0", "p0", "p0", "p1"]
    no_tie = RouteRequest(LONG, 16, cached_blocks=(("p1", 1),))
    rng = random.Random(11)
    state = rng.getstate()
    assert cache_aware(no_tie, tie, rng).prefill_id == "p1"
    assert rng.getstate() == state


def test_cache_aware_prefills_locally_when_the_chosen_both_worker_holds_the_prompt():
    snap = snapshot(worker("b0", "both"), worker("p0", "prefill"))
    request = RouteRequest(LONG, 16, cached_blocks=(("b0", 63),))
    decision = cache_aware(request, snap, random.Random(0))
    assert (decision.prefill_id, decision.decode_id) == (None, "b0")
    assert decision.reason.startswith(
        "cache_aware: prefill on decode worker (lowest cost 0: 63/63 blocks cached, 0 tokens"
    )


def test_least_loaded_counts_the_decode_workers_cached_blocks_as_room():
    snap = snapshot(worker("d0", "decode", free_blocks=70), worker("d1", "decode", free_blocks=30))
    request = RouteRequest(LONG, 16, cached_blocks=(("d1", 60),))
    decision = least_loaded(request, snap, random.Random(0))
    assert decision.decode_id == "d1"
    assert dict(decision.inputs)["decode_cached_blocks"] == 60.0
    assert dict(decision.inputs)["decode_headroom_blocks"] == 27.0
