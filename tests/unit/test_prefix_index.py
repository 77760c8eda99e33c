"""The router's prefix index on hand-built events: exact matches, fencing, pruning and bounds."""

from __future__ import annotations

import pytest

from engine.kv_cache.hashing import hash_full_blocks
from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.routing.policy import RouteRequest
from router.routing.prefix_index import BlockEvent, PrefixIndex, route_request

PROMPT = list(range(100, 164))  # 64 tokens: 4 blocks of 16, 2 blocks of 32
H = hash_full_blocks(PROMPT, 16)  # h0..h3, chained
OTHER = hash_full_blocks(list(range(900, 964)), 16)


def event(worker_id: str, kind: str, hashes, incarnation: str = "inc-1") -> BlockEvent:
    return BlockEvent(worker_id, incarnation, kind, tuple(hashes))


def worker(worker_id: str, incarnation: str = "inc-1", block_size: int = 16) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role="decode", address="127.0.0.1:1", metrics_address="",
        incarnation=incarnation, block_size=block_size, total_blocks=100, free_blocks=100,
        reserved_blocks=0, cached_blocks=0, num_running=0, num_waiting=0,
        queued_prefill_tokens=0, max_model_len=4096, updated_at=1.0,
    )  # fmt: skip


def snapshot(*workers: WorkerInfo, taken_at: float = 10.0, stale: bool = False) -> ClusterSnapshot:
    return ClusterSnapshot(workers=tuple(workers), taken_at=taken_at, stale=stale)


def test_match_counts_each_workers_leading_blocks_and_stops_at_its_first_miss():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H[:3]))
    index.apply(event("w1", "stored", [H[0], H[2], H[3]]))
    index.apply(event("w2", "stored", H[1:]))  # no first block: no usable prefix
    assert index.match(H) == {"w0": 3, "w1": 1}
    assert index.match(OTHER) == {}
    assert index.match([]) == {}


def test_a_worker_holding_the_whole_prompt_matches_every_block():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H))
    assert index.match(H) == {"w0": 4}


def test_match_stops_consuming_hashes_once_no_worker_matches():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H[:2]))
    consumed = []

    def lazy():
        for h in H:
            consumed.append(h)
            yield h

    assert index.match(lazy()) == {"w0": 2}
    assert consumed == H[:3]


def test_evicted_removes_blocks_and_snapshot_replaces_everything_a_worker_held():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H))
    index.apply(event("w0", "evicted", [H[3], H[2], OTHER[0]]))  # unknown hash: ignored
    assert index.blocks_of("w0") == frozenset(H[:2])
    index.apply(event("w0", "snapshot", OTHER[:2]))
    assert index.blocks_of("w0") == frozenset(OTHER[:2])
    assert index.match(H) == {}
    assert len(index) == 2
    assert index.applied == 3


def test_two_workers_share_a_block_until_one_evicts_it():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H[:2]))
    index.apply(event("w1", "stored", H[:2]))
    index.apply(event("w1", "evicted", [H[1]]))
    assert index.match(H) == {"w0": 2, "w1": 1}
    assert len(index) == 2


def test_a_new_incarnation_replaces_the_old_ones_entries_and_fences_its_late_events():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H, incarnation="a"))
    assert index.apply(event("w0", "snapshot", H[:1], incarnation="b")) is True
    assert index.workers() == {"w0": "b"}
    assert index.match(H) == {"w0": 1}
    assert index.apply(event("w0", "stored", H, incarnation="a")) is False  # a's late write
    assert (index.match(H), index.fenced) == ({"w0": 1}, 1)


def test_prune_drops_a_worker_only_after_it_is_absent_for_the_grace_period():
    index = PrefixIndex(absent_grace_s=3.0)
    index.apply(event("w0", "stored", H))
    index.apply(event("w1", "stored", H[:1]))
    assert index.prune(snapshot(worker("w1"), taken_at=10.0)) == ()
    assert index.prune(snapshot(worker("w1"), taken_at=12.9)) == ()
    assert index.prune(snapshot(worker("w1"), taken_at=13.0)) == ("w0",)
    assert index.workers() == {"w1": "inc-1"}
    assert index.match(H) == {"w1": 1}
    assert len(index) == 1


def test_a_worker_that_reappears_within_the_grace_period_keeps_its_blocks():
    index = PrefixIndex(absent_grace_s=3.0)
    index.apply(event("w0", "stored", H))
    index.prune(snapshot(taken_at=10.0))  # e.g. Redis restarted empty, heartbeats not back yet
    index.prune(snapshot(worker("w0"), taken_at=11.0))
    assert index.prune(snapshot(taken_at=13.5)) == ()  # absent again: the clock restarts
    assert index.match(H) == {"w0": 4}


def test_prune_ignores_a_stale_snapshot():
    index = PrefixIndex(absent_grace_s=0.0)
    index.apply(event("w0", "stored", H))
    assert index.prune(snapshot(taken_at=100.0, stale=True)) == ()
    assert index.match(H) == {"w0": 4}


def test_a_heartbeat_with_a_newer_incarnation_clears_the_older_runs_entries():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H, incarnation="a"))
    index.prune(snapshot(worker("w0", incarnation="b")))
    assert (index.workers(), index.match(H)) == ({"w0": "b"}, {})
    assert index.apply(event("w0", "stored", H, incarnation="a")) is False
    assert index.apply(event("w0", "stored", H[:2], incarnation="b")) is True
    assert index.match(H) == {"w0": 2}


def test_a_heartbeat_lagging_behind_the_stream_does_not_undo_a_restart():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H, incarnation="a"))
    index.apply(event("w0", "snapshot", H[:3], incarnation="b"))  # b's events came first
    index.prune(snapshot(worker("w0", incarnation="a")))  # a's heartbeat not yet replaced
    assert (index.workers(), index.match(H)) == ({"w0": "b"}, {"w0": 3})


def test_dropping_a_worker_frees_its_slot_but_does_not_fence_its_incarnation():
    index = PrefixIndex(max_workers=1)
    index.apply(event("w0", "stored", H))
    assert index.apply(event("w1", "stored", H)) is False
    assert index.rejected == 1
    assert index.drop_worker("w0") == 4
    assert (len(index), index.workers()) == (0, {})
    assert index.apply(event("w1", "stored", H[:1])) is True
    index.drop_worker("w1")
    assert index.apply(event("w1", "stored", H[:2])) is True  # same run back after Redis lost it
    assert index.match(H) == {"w1": 2}
    assert index.drop_worker("nobody") == 0


def test_a_worker_over_its_block_bound_forgets_its_oldest_stored_hashes():
    index = PrefixIndex(max_blocks_per_worker=3)
    index.apply(event("w0", "stored", H[:3]))
    index.apply(event("w0", "stored", [H[0]]))  # re-stored: now the newest
    index.apply(event("w0", "stored", [H[3]]))
    assert index.blocks_of("w0") == frozenset([H[0], H[2], H[3]])
    assert (index.truncated, len(index)) == (1, 3)
    assert index.match(H) == {"w0": 1}


def test_block_event_fields_round_trip_with_binary_hashes():
    original = event("w0", "stored", H[:2])
    fields = original.to_fields()
    assert fields == {
        "worker_id": b"w0", "incarnation": b"inc-1", "kind": b"stored", "hashes": H[0] + H[1],
    }  # fmt: skip
    as_read = {k.encode(): v for k, v in fields.items()}  # XREAD gives bytes keys
    assert BlockEvent.from_fields(as_read) == original
    empty = BlockEvent.from_fields(event("w0", "snapshot", ()).to_fields())
    assert empty.hashes == ()


def test_block_event_rejects_malformed_fields_with_the_reason():
    good = event("w0", "stored", H[:1]).to_fields()
    with pytest.raises(ValueError, match="lacks field\\(s\\): kind"):
        BlockEvent.from_fields({k: v for k, v in good.items() if k != "kind"})
    with pytest.raises(ValueError, match="33 bytes, not a multiple of 32"):
        BlockEvent.from_fields({**good, "hashes": H[0] + b"x"})
    with pytest.raises(ValueError, match="kind must be one of stored, evicted, snapshot"):
        BlockEvent.from_fields({**good, "kind": b"moved"})
    with pytest.raises(ValueError, match="must be bytes"):
        BlockEvent.from_fields({**good, "hashes": "text"})
    with pytest.raises(ValueError, match="32 bytes"):
        BlockEvent("w0", "inc-1", "stored", (b"short",))


def test_route_request_counts_cached_blocks_in_each_workers_own_block_size():
    index = PrefixIndex()
    index.apply(event("d16", "stored", H[:3]))
    index.apply(event("d32", "stored", hash_full_blocks(PROMPT, 32)[:1]))
    index.apply(event("gone", "stored", H))  # not in the snapshot: not offered
    snap = snapshot(worker("d16"), worker("d32", block_size=32), worker("idle"))
    assert route_request(PROMPT + [7], 5, snap, index) == RouteRequest(
        num_prompt_tokens=65, max_tokens=5, cached_blocks=(("d16", 3), ("d32", 1)),
        held_blocks=(("d16", 3), ("d32", 1)),
    )


def test_route_request_counts_every_block_the_index_holds_for_each_worker():
    index = PrefixIndex()
    index.apply(event("w0", "stored", H[:2]))
    index.apply(event("w0", "stored", OTHER))  # another prompt's blocks count too
    index.apply(event("w1", "stored", OTHER[:1]))
    index.apply(event("w1", "evicted", OTHER[:1]))  # evicted: holds none
    index.apply(event("old", "stored", H, incarnation="inc-0"))  # another run's: nothing
    snap = snapshot(worker("w0"), worker("w1"), worker("old"))
    request = route_request(PROMPT, None, snap, index)
    assert request.held_blocks == (("w0", 6),)
    assert request.cached_blocks == (("w0", 2),)
    assert (request.held_by("w0"), request.held_by("w1"), request.held_by("old")) == (6, 0, 0)


def test_route_request_ignores_entries_of_another_incarnation_than_the_heartbeats():
    index = PrefixIndex()
    index.apply(event("d0", "stored", H, incarnation="old"))
    snap = snapshot(worker("d0", incarnation="new"))
    assert route_request(PROMPT, None, snap, index).cached_blocks == ()
    assert route_request(PROMPT, None, snap, index).held_blocks == ()


def test_a_routed_request_makes_its_workers_match_its_prompt_before_any_event():
    from router.cluster.kv_event_reader import KVEventReader

    reader = KVEventReader("redis://127.0.0.1:1/0", "test")  # no I/O: only the index is used
    snap = snapshot(worker("p0", block_size=16), worker("d0", block_size=8), worker("p1"))
    prompt = list(range(40))
    reader.note_routed(["p0", "d0"], prompt, snap)
    # p0 holds 2 blocks of 16, d0 5 blocks of 8 (each in its own block size); p1 nothing.
    assert route_request(prompt, 4, snap, reader.index).cached_blocks == (("d0", 5), ("p0", 2))
    assert reader.index.blocks_of("p0") == frozenset(hash_full_blocks(prompt, 16))


def count_hashing(monkeypatch, seen) -> None:
    """seen(token_ids) on every block hashed, one at a time or by hash_full_blocks."""
    from engine.kv_cache import hashing
    from router.routing import prefix_index

    real = hashing.hash_block

    def counted(parent, ids):
        seen(ids)
        return real(parent, ids)

    monkeypatch.setattr(hashing, "hash_block", counted)
    monkeypatch.setattr(prefix_index, "hash_block", counted)


def test_a_prompts_hashes_are_computed_once_and_only_as_far_as_read(monkeypatch):
    from router.routing import prefix_index

    h32 = tuple(hash_full_blocks(PROMPT, 32))  # before counting starts
    calls = []
    count_hashing(monkeypatch, lambda ids: calls.append(len(ids)))
    hashes = prefix_index.PromptHashes(PROMPT + [7])
    index = PrefixIndex()
    index.apply(event("d0", "stored", H[:1]))
    assert index.match(hashes.lazily(16)) == {"d0": 1}
    assert calls == [16, 16]  # the match stopped at the first block nobody holds
    assert hashes.all(16) == tuple(H) and len(calls) == 4  # the rest, once
    assert hashes.all(16) == tuple(H) and list(hashes.lazily(16)) == H and len(calls) == 4
    assert hashes.all(32) == h32 and len(calls) == 6  # each size apart
    assert len(hashes) == 65 and prefix_index.PromptHashes([1, 2]).all(16) == ()


def test_routing_then_noting_a_request_hashes_its_prompt_once(monkeypatch):
    from router.cluster.kv_event_reader import KVEventReader
    from router.routing import prefix_index

    reader = KVEventReader("redis://127.0.0.1:1/0", "test")  # no I/O: only the index is used
    snap = snapshot(worker("p0"), worker("d0"))
    reader.note_routed(["d0"], PROMPT, snap)  # d0 holds the whole prompt: routing reads every block
    calls = []
    count_hashing(monkeypatch, lambda ids: calls.append(1))
    hashes = prefix_index.PromptHashes(PROMPT)
    assert reader.route_request(hashes, 4, snap).cached_blocks == (("d0", 4),)
    reader.note_routed(["p0", "d0"], hashes, snap)
    assert len(calls) == 4
    assert reader.index.blocks_of("p0") == frozenset(H)
