"""Routing policies on fixed snapshots with a seeded rng: exact choices, reasons and inputs."""

from __future__ import annotations

import random

import pytest

from router.cluster_keys import ClusterSnapshot, WorkerInfo
from router.cluster_state import fence_incarnations
from router.policy import (
    POLICIES,
    LeastLoaded,
    RoundRobin,
    RouteDecision,
    RouteRequest,
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


@pytest.mark.parametrize("name", ["round_robin", "least_loaded"])
def test_every_policy_returns_none_without_a_decode_worker(name):
    only_prefill = snapshot(worker("p0", "prefill"))
    assert make_policy(name).choose(REQUEST, only_prefill, random.Random(0)) is None
    assert make_policy(name).choose(REQUEST, snapshot(), random.Random(0)) is None


def test_registry_knows_both_policies_and_lists_them_for_an_unknown_name():
    assert POLICIES.names() == ["least_loaded", "round_robin"]
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    with pytest.raises(KeyError) as info:
        make_policy("random")
    assert info.value.args[0] == "unknown routing policy 'random'; known: least_loaded, round_robin"


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
