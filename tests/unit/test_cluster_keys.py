"""Cluster state key schema, WorkerInfo's hash round trip, and snapshot helpers."""

from __future__ import annotations

import dataclasses

import pytest

from router.cluster.keys import (
    COUNTERS_SIGNATURE_FIELD,
    SIGNATURE_FIELD,
    ClusterSnapshot,
    UnsignedEntry,
    WorkerInfo,
    signed_hash,
    verified_info,
    worker_key,
    workers_set_key,
)


def make_worker(**overrides) -> WorkerInfo:
    values = dict(
        worker_id="decode-0",
        role="decode",
        address="127.0.0.1:50051",
        metrics_address="127.0.0.1:9100",
        incarnation="3f2a9c",
        block_size=16,
        total_blocks=1024,
        free_blocks=900,
        reserved_blocks=12,
        cached_blocks=40,
        num_running=3,
        num_waiting=1,
        queued_prefill_tokens=512,
        max_model_len=8192,
        updated_at=1718000000.123456,
    )
    values.update(overrides)
    return WorkerInfo(**values)


def test_keys_live_under_the_cluster_prefix():
    assert worker_key("prod", "decode-0") == "pdserve:prod:worker:decode-0"
    assert workers_set_key("prod") == "pdserve:prod:workers"


def test_empty_cluster_or_worker_id_is_rejected_in_keys():
    with pytest.raises(ValueError, match="cluster name must not be empty"):
        workers_set_key("")
    with pytest.raises(ValueError, match="worker_id must not be empty"):
        worker_key("prod", "")


def test_to_hash_writes_every_field_as_a_string():
    assert make_worker().to_hash() == {
        "worker_id": "decode-0",
        "role": "decode",
        "address": "127.0.0.1:50051",
        "metrics_address": "127.0.0.1:9100",
        "incarnation": "3f2a9c",
        "block_size": "16",
        "total_blocks": "1024",
        "free_blocks": "900",
        "reserved_blocks": "12",
        "cached_blocks": "40",
        "num_running": "3",
        "num_waiting": "1",
        "queued_prefill_tokens": "512",
        "max_model_len": "8192",
        "updated_at": "1718000000.123456",
        "state": "serving",
        "prefix_cache_queries": "0",
        "prefix_cache_hits": "0",
        "prompt_tokens": "0",
        "generation_tokens": "0",
        "prefill_busy_s": "0.0",
        "decode_busy_s": "0.0",
        "link_address": "",
    }


def test_a_hash_without_state_reads_as_serving_and_a_bad_state_is_refused():
    text = make_worker().to_hash()
    del text["state"]  # a worker of the previous release
    assert WorkerInfo.from_hash(text).state == "serving"
    with pytest.raises(ValueError, match="state must be one of starting, serving, draining, stopped"):
        make_worker(state="resting")
    assert make_worker(state="draining").draining


def test_hash_round_trips_through_bytes_as_hgetall_returns_them():
    worker = make_worker(metrics_address="", role="both")
    as_bytes = {k.encode(): v.encode() for k, v in worker.to_hash().items()}
    assert WorkerInfo.from_hash(as_bytes) == worker
    assert WorkerInfo.from_hash(worker.to_hash()) == worker


def test_from_hash_ignores_fields_it_does_not_know():
    data = make_worker().to_hash() | {"throughput_tokens_per_s": "1234.5"}
    assert WorkerInfo.from_hash(data) == make_worker()


def test_from_hash_names_the_missing_fields():
    data = make_worker().to_hash()
    del data["free_blocks"], data["incarnation"]
    with pytest.raises(ValueError) as info:
        WorkerInfo.from_hash(data)
    assert str(info.value) == "worker hash lacks field(s): incarnation, free_blocks"


def test_from_hash_names_a_field_that_is_not_a_number():
    data = make_worker().to_hash() | {"free_blocks": "many"}
    with pytest.raises(ValueError) as info:
        WorkerInfo.from_hash(data)
    assert str(info.value) == "worker hash field free_blocks is not a number: 'many'"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("role", "router", "role must be one of prefill, decode, both; got 'router'"),
        ("free_blocks", "-1", "worker 'decode-0': free_blocks must be an int >= 0; got -1"),
        ("block_size", "0", "worker 'decode-0': block_size must be >= 1"),
        ("updated_at", "nan", "worker 'decode-0': updated_at must be a finite number; got nan"),
        ("incarnation", "", "worker 'decode-0': incarnation must not be empty"),
        ("address", "", "worker 'decode-0': address must not be empty"),
    ],
)
def test_from_hash_rejects_invalid_values(field, value, message):
    data = make_worker().to_hash() | {field: value}
    with pytest.raises(ValueError) as info:
        WorkerInfo.from_hash(data)
    assert str(info.value) == message


def test_from_hash_rejects_bytes_that_are_not_utf8():
    data = {k.encode(): v.encode() for k, v in make_worker().to_hash().items()}
    data[b"worker_id"] = b"\xff\xfe"
    with pytest.raises(ValueError, match="not UTF-8"):
        WorkerInfo.from_hash(data)


def test_worker_info_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_worker().free_blocks = 0  # type: ignore[misc]


def test_snapshot_counts_role_both_as_prefill_and_decode():
    p = make_worker(worker_id="p", role="prefill")
    d = make_worker(worker_id="d", role="decode")
    b = make_worker(worker_id="b", role="both")
    snapshot = ClusterSnapshot(workers=(b, d, p), taken_at=5.0, stale=False)
    assert [w.worker_id for w in snapshot.prefill_workers()] == ["b", "p"]
    assert [w.worker_id for w in snapshot.decode_workers()] == ["b", "d"]
    assert snapshot.by_id("d") is d
    assert snapshot.by_id("gone") is None


SECRET = b"unit-secret"


def as_redis_bytes(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_a_signed_heartbeat_verifies_and_parses_back_to_the_same_info():
    info = make_worker()
    stored = signed_hash(info, "prod", SECRET)
    assert set(stored) == set(info.to_hash()) | {SIGNATURE_FIELD, COUNTERS_SIGNATURE_FIELD, "busy_signature",
                                                   "link_signature"}
    assert verified_info(as_redis_bytes(stored), "prod", SECRET) == info


@pytest.mark.parametrize(
    "field, value",
    [("address", "10.0.0.66:50051"), ("role", "prefill"), ("worker_id", "decode-1"),
     ("incarnation", "ffffff"), ("updated_at", "1718009999.0"), ("free_blocks", "1024"),
     ("prefix_cache_hits", "7"), ("generation_tokens", "99")],
)  # fmt: skip
def test_changing_any_signed_field_breaks_the_signature(field, value):
    stored = signed_hash(make_worker(), "prod", SECRET)
    stored[field] = value
    with pytest.raises(UnsignedEntry, match="signature does not verify"):  # the counters have their own
        verified_info(stored, "prod", SECRET)


def test_a_heartbeat_is_refused_when_unsigned_signed_with_another_secret_or_for_another_cluster():
    info = make_worker()
    with pytest.raises(UnsignedEntry, match="heartbeat has no signature"):
        verified_info(info.to_hash(), "prod", SECRET)
    with pytest.raises(UnsignedEntry, match="does not verify"):
        verified_info(signed_hash(info, "prod", b"other"), "prod", SECRET)
    with pytest.raises(UnsignedEntry, match="does not verify"):
        verified_info(signed_hash(info, "staging", SECRET), "prod", SECRET)


def test_without_a_secret_any_parsable_heartbeat_is_taken():
    info = make_worker()
    assert verified_info(info.to_hash(), "prod", None) == info
    assert verified_info(signed_hash(info, "prod", SECRET), "prod", None) == info


def test_a_heartbeat_without_the_token_counters_verifies_and_reads_them_as_zero():
    """A worker of the release before the counters signs and writes none of them."""
    info = make_worker()
    counters = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")
    later = ("prefill_busy_s", "decode_busy_s", "busy_signature",  # came after the counters
             "link_address", "link_signature")
    text = {k: v for k, v in signed_hash(info, "prod", SECRET).items()
            if k not in counters + later and k != COUNTERS_SIGNATURE_FIELD}
    parsed = verified_info(as_redis_bytes(text), "prod", SECRET)
    assert parsed == info
    assert [getattr(parsed, name) for name in counters] == [0, 0, 0, 0]


def test_the_base_signature_is_the_previous_releases_so_an_older_router_takes_the_heartbeat():
    """The previous release signed every field it knew (all but the counters), in order."""
    import dataclasses

    from proto.auth import verify

    info = dataclasses.replace(make_worker(), prompt_tokens=5, generation_tokens=2)
    stored = signed_hash(info, "prod", SECRET)
    previous = [f.name for f in dataclasses.fields(WorkerInfo)][:16]
    assert previous[-1] == "state"
    parts = ["pdserve-heartbeat-v1", "prod"] + [part for name in previous for part in (name, stored[name])]
    assert verify(SECRET, stored[SIGNATURE_FIELD], *parts)


def test_counters_without_their_signature_are_refused():
    stored = signed_hash(make_worker(), "prod", SECRET)
    del stored[COUNTERS_SIGNATURE_FIELD]
    with pytest.raises(UnsignedEntry, match="heartbeat counters signature does not verify"):
        verified_info(stored, "prod", SECRET)


def test_token_counters_round_trip_through_a_signed_heartbeat():
    import dataclasses

    info = dataclasses.replace(make_worker(), prefix_cache_queries=320, prefix_cache_hits=128,
                               prompt_tokens=192, generation_tokens=45)
    parsed = verified_info(as_redis_bytes(signed_hash(info, "prod", SECRET)), "prod", SECRET)
    assert (parsed.prefix_cache_queries, parsed.prefix_cache_hits, parsed.prompt_tokens,
            parsed.generation_tokens) == (320, 128, 192, 45)


def test_busy_seconds_round_trip_through_a_signed_heartbeat_and_a_change_is_refused():
    import dataclasses

    info = dataclasses.replace(make_worker(), prompt_tokens=900, prefill_busy_s=1.5, decode_busy_s=0.25)
    stored = signed_hash(info, "prod", SECRET)
    parsed = verified_info(as_redis_bytes(stored), "prod", SECRET)
    assert (parsed.prefill_busy_s, parsed.decode_busy_s) == (1.5, 0.25)
    stored["prefill_busy_s"] = "0.5"  # a faster-looking worker
    with pytest.raises(UnsignedEntry, match="heartbeat busy-time signature does not verify"):
        verified_info(stored, "prod", SECRET)


def test_the_counters_signature_is_the_previous_releases_so_a_router_before_busy_time_takes_it():
    """The release before the busy seconds signed the counters over the fields it knew, in order."""
    import dataclasses

    from proto.auth import verify

    info = dataclasses.replace(make_worker(), prompt_tokens=5, prefill_busy_s=2.0)
    stored = signed_hash(info, "prod", SECRET)
    previous = [f.name for f in dataclasses.fields(WorkerInfo)][:20]
    assert previous[-1] == "generation_tokens"
    parts = ["pdserve-heartbeat-counters-v1", "prod"] + [part for name in previous for part in (name, stored[name])]
    assert verify(SECRET, stored[COUNTERS_SIGNATURE_FIELD], *parts)


def test_a_heartbeat_without_busy_seconds_verifies_and_reads_them_as_zero():
    info = make_worker()
    text = {k: v for k, v in signed_hash(info, "prod", SECRET).items()
            if k not in ("prefill_busy_s", "decode_busy_s", "busy_signature", "link_address", "link_signature")}
    parsed = verified_info(as_redis_bytes(text), "prod", SECRET)
    assert (parsed.prefill_busy_s, parsed.decode_busy_s) == (0.0, 0.0)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_busy_seconds_must_be_finite_and_not_negative(value):
    import dataclasses

    with pytest.raises(ValueError, match="prefill_busy_s must be a finite number >= 0"):
        dataclasses.replace(make_worker(), prefill_busy_s=value)


def test_the_link_address_round_trips_and_a_changed_one_is_refused():
    """A heartbeat's link address is where routers send prompts: Redis write access alone must
    not redirect it."""
    import dataclasses

    info = dataclasses.replace(make_worker(), link_address="10.0.0.5:50052")
    stored = signed_hash(info, "prod", SECRET)
    assert verified_info(as_redis_bytes(stored), "prod", SECRET).link_address == "10.0.0.5:50052"
    stored["link_address"] = "10.6.6.6:50052"
    with pytest.raises(UnsignedEntry, match="heartbeat link address signature does not verify"):
        verified_info(stored, "prod", SECRET)


def test_a_heartbeat_without_a_link_verifies_and_reads_no_link():
    """A worker of the release before the link writes neither the address nor its signature."""
    info = make_worker()
    text = {k: v for k, v in signed_hash(info, "prod", SECRET).items()
            if k not in ("link_address", "link_signature")}
    assert verified_info(as_redis_bytes(text), "prod", SECRET).link_address == ""


def test_the_busy_signature_is_the_previous_releases_so_a_router_before_the_link_takes_it():
    import dataclasses

    from proto.auth import verify

    info = dataclasses.replace(make_worker(), prefill_busy_s=2.0, link_address="10.0.0.5:50052")
    stored = signed_hash(info, "prod", SECRET)
    previous = [f.name for f in dataclasses.fields(WorkerInfo)][:22]
    assert previous[-1] == "decode_busy_s"
    parts = ["pdserve-heartbeat-busy-v1", "prod"] + [part for name in previous for part in (name, stored[name])]
    assert verify(SECRET, stored["busy_signature"], *parts)


def test_a_link_address_must_be_host_and_port():
    import dataclasses

    with pytest.raises(ValueError, match="link_address must be host:port"):
        dataclasses.replace(make_worker(), link_address="nohost")


def test_with_queued_prefill_tokens_is_the_entry_with_that_count_and_refuses_a_bad_one():
    worker = make_worker(queued_prefill_tokens=3)
    loaded = worker.with_queued_prefill_tokens(40)
    assert loaded == dataclasses.replace(worker, queued_prefill_tokens=40)
    assert worker.queued_prefill_tokens == 3  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.queued_prefill_tokens = 1  # type: ignore[misc]
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="queued_prefill_tokens must be an int >= 0"):
            worker.with_queued_prefill_tokens(bad)  # type: ignore[arg-type]
