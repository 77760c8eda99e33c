"""Heartbeats and cluster snapshots through a real (embedded) Redis on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import pytest

from worker_runtime.heartbeat import HeartbeatPublisher
from pdserve.redis_server import EmbeddedRedis, free_port
from router.cluster.redis_settings import PASSWORD_ENV, sync_client
from router.cluster.keys import WorkerInfo, signed_hash, worker_key, workers_set_key
from router.cluster.state import ClusterSnapshot, ClusterStateReader

pytestmark = pytest.mark.timeout(60)

PASSWORD = "service-test-password"
"""Every embedded Redis here (restarts included) has it; clients find it in the environment."""


@pytest.fixture(autouse=True)
def redis_password_in_env(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)

CLUSTER = "test"
INTERVAL_S = 0.2


class FakeWorker:
    """The info() a worker would give its publisher: fixed load, a fresh timestamp."""

    def __init__(self, worker_id: str, incarnation: str = "inc-1", **load: int) -> None:
        self.info = WorkerInfo(
            worker_id=worker_id,
            role="decode",
            address="127.0.0.1:50051",
            metrics_address="",
            incarnation=incarnation,
            block_size=16,
            total_blocks=64,
            free_blocks=load.get("free_blocks", 60),
            reserved_blocks=0,
            cached_blocks=0,
            num_running=load.get("num_running", 1),
            num_waiting=0,
            queued_prefill_tokens=0,
            max_model_len=1024,
            updated_at=0.0,
        )

    def __call__(self) -> WorkerInfo:
        return dataclasses.replace(self.info, updated_at=time.time())


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded


@pytest.fixture
def publishers() -> Iterator[list[HeartbeatPublisher]]:
    """Publishers a test starts; stopped at teardown even if the test fails."""
    started: list[HeartbeatPublisher] = []
    yield started
    for publisher in started:
        publisher.stop()


def start_publisher(
    started: list[HeartbeatPublisher], url: str, worker: FakeWorker, ttl_s: float = 1.0
) -> HeartbeatPublisher:
    publisher = HeartbeatPublisher(url, CLUSTER, worker, interval_s=INTERVAL_S, ttl_s=ttl_s)
    started.append(publisher)
    publisher.start()
    return publisher


async def wait_for_snapshot(
    reader: ClusterStateReader, shows: Callable[[ClusterSnapshot], bool], timeout_s: float
) -> tuple[ClusterSnapshot, float]:
    """Poll the reader until its snapshot satisfies `shows`; returns it and the seconds it
    took. Fails after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        snapshot = await reader.snapshot()
        if shows(snapshot):
            return snapshot, time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"no snapshot as expected within {timeout_s} s; last: {snapshot}")


def worker_ids(snapshot) -> list[str]:
    return [w.worker_id for w in snapshot.workers]


def test_reader_sees_a_published_worker_within_one_interval(server, publishers):
    start_publisher(publishers, server.url, FakeWorker("decode-0", free_blocks=42))

    async def main() -> None:
        reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0)
        try:
            snapshot, took = await wait_for_snapshot(
                reader, lambda s: worker_ids(s) == ["decode-0"], timeout_s=2.0
            )
            assert took < INTERVAL_S
            assert snapshot.stale is False
            assert snapshot.by_id("decode-0").free_blocks == 42
            assert snapshot.decode_workers() == snapshot.workers
            assert (reader.redis_ok, reader.consecutive_failures) == (True, 0)
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_heartbeat_sets_a_ttl_and_registers_in_the_workers_set(server):
    publisher = HeartbeatPublisher(server.url, CLUSTER, FakeWorker("p"), interval_s=1.0, ttl_s=3.0)
    client = sync_client(server.url, decode_responses=True)
    try:
        assert publisher.beat() is True
        key = worker_key(CLUSTER, "p")
        assert 2900 < client.pttl(key) <= 3000
        assert client.smembers(workers_set_key(CLUSTER)) == {"p"}
        assert client.hget(key, "incarnation") == "inc-1"
        assert publisher.beats == 1
    finally:
        publisher.stop()
        client.close()


def test_stop_removes_the_worker_from_redis_and_the_next_snapshot(server, publishers):
    publisher = start_publisher(publishers, server.url, FakeWorker("decode-0"))

    async def main() -> None:
        reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0)
        try:
            await wait_for_snapshot(reader, lambda s: len(s.workers) == 1, timeout_s=2.0)
            publisher.stop()
            assert worker_ids(await reader.snapshot()) == []
        finally:
            await reader.aclose()

    asyncio.run(main())
    client = sync_client(server.url)
    try:
        assert client.exists(worker_key(CLUSTER, "decode-0")) == 0
        assert client.smembers(workers_set_key(CLUSTER)) == set()
    finally:
        client.close()


def test_a_worker_that_stops_beating_expires_after_its_ttl(server):
    # One beat and no more: a worker that crashed, so nothing unregisters it.
    crashed = HeartbeatPublisher(server.url, CLUSTER, FakeWorker("gone"), interval_s=0.5, ttl_s=1.0)
    assert crashed.beat() is True

    async def main() -> None:
        reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0)
        try:
            assert worker_ids(await reader.snapshot()) == ["gone"]
            _, took = await wait_for_snapshot(reader, lambda s: s.workers == (), timeout_s=3.0)
            assert 0.5 < took < 1.5
        finally:
            await reader.aclose()

    asyncio.run(main())
    client = sync_client(server.url)
    try:
        assert client.smembers(workers_set_key(CLUSTER)) == set()  # the reader removed it
    finally:
        client.close()
        crashed.stop()


def test_snapshots_are_cached_for_max_age(server, publishers):
    now = [100.0]
    start_publisher(publishers, server.url, FakeWorker("decode-0"))

    async def main() -> None:
        reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.1, clock=lambda: now[0])
        try:
            first = await reader.snapshot()  # may be empty: the first beat races the read
            now[0] += 0.0625
            assert await reader.snapshot() is first
            await asyncio.sleep(INTERVAL_S + 0.3)
            now[0] += 0.0625
            refreshed = await reader.snapshot()
            assert refreshed is not first
            assert worker_ids(refreshed) == ["decode-0"]
            assert refreshed.taken_at == 100.125
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_a_restarted_worker_replaces_its_previous_incarnation(server, publishers):
    # The old process beat once, then hung; its stop() comes after the new one registered.
    old = HeartbeatPublisher(
        server.url, CLUSTER, FakeWorker("decode-0", incarnation="old"), INTERVAL_S, ttl_s=5.0
    )
    assert old.beat() is True

    async def main() -> None:
        reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0)

        def incarnations(snapshot: ClusterSnapshot) -> list[str]:
            return [w.incarnation for w in snapshot.workers]

        try:
            assert incarnations(await reader.snapshot()) == ["old"]
            start_publisher(publishers, server.url, FakeWorker("decode-0", incarnation="new"))
            await wait_for_snapshot(reader, lambda s: incarnations(s) == ["new"], timeout_s=2.0)
            old.stop()  # unregisters only its own incarnation: the new entry stays
            assert incarnations(await reader.snapshot()) == ["new"]
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_reader_routes_on_its_last_snapshot_while_redis_is_down_then_catches_up(
    publishers, caplog
):
    caplog.set_level(logging.INFO)
    port = free_port()
    ttl_s = 1.0
    first = EmbeddedRedis(port=port, password=PASSWORD).start()
    second: EmbeddedRedis | None = None
    try:
        url = first.url
        worker = FakeWorker("decode-0", free_blocks=50)
        start_publisher(publishers, url, worker, ttl_s=ttl_s)

        async def main() -> None:
            nonlocal second
            reader = ClusterStateReader(url, CLUSTER, max_age_s=0.0, retry_interval_s=0.05)
            try:
                def free(snapshot: ClusterSnapshot) -> list[int]:
                    return [w.free_blocks for w in snapshot.workers]

                held, _ = await wait_for_snapshot(reader, lambda s: free(s) == [50], 2.0)
                first.kill()

                down = await reader.snapshot()
                assert down.stale is True
                assert down.workers == held.workers
                assert down.taken_at == held.taken_at
                assert reader.redis_ok is False
                await asyncio.sleep(1.5 * INTERVAL_S)  # the publisher misses a beat too
                assert (await reader.snapshot()).stale is True
                assert reader.consecutive_failures == 2

                worker.info = dataclasses.replace(worker.info, free_blocks=30)
                second = EmbeddedRedis(port=port, password=PASSWORD).start()  # empty: the publisher re-registers
                back, took = await wait_for_snapshot(reader, lambda s: free(s) == [30], ttl_s)
                assert took < ttl_s
                assert back.stale is False
                assert (reader.redis_ok, reader.consecutive_failures) == (True, 0)
            finally:
                await reader.aclose()

        asyncio.run(main())
    finally:
        for publisher in publishers:
            publisher.stop()
        first.stop()
        if second is not None:
            second.stop()

    reader_logs = [r for r in caplog.records if r.name == "router.cluster.state"]
    assert [r.levelname for r in reader_logs] == ["WARNING", "INFO"]
    assert reader_logs[1].getMessage().startswith(
        f"Redis at {url} is readable again after 2 failed reads; "
    )
    heartbeat_logs = [r for r in caplog.records if r.name == "worker_runtime.heartbeat"]
    assert [r.levelname for r in heartbeat_logs] == ["WARNING", "INFO"]


def test_wait_first_beat_returns_once_the_worker_is_registered(server, publishers):
    publisher = HeartbeatPublisher(server.url, CLUSTER, FakeWorker("p"), interval_s=30.0, ttl_s=60.0)
    publishers.append(publisher)
    client = sync_client(server.url, decode_responses=True)
    try:
        publisher.start()
        assert publisher.wait_first_beat(5.0) is True
        # no later beat is due for 30 s: the entry is there because the wait waited for it
        assert client.smembers(workers_set_key(CLUSTER)) == {"p"}
    finally:
        client.close()


def test_wait_first_beat_is_bounded_and_false_without_redis(publishers):
    publisher = start_publisher(publishers, f"redis://127.0.0.1:{free_port()}/0", FakeWorker("p"))
    start = time.monotonic()
    assert publisher.wait_first_beat(5.0) is False
    assert time.monotonic() - start < 2.0  # the one try gave up (socket timeout <= interval)


def test_heartbeat_keeps_trying_while_redis_is_down_and_logs_once(publishers, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    publisher = start_publisher(publishers, url, FakeWorker("decode-0"))
    deadline = time.monotonic() + 5.0
    while publisher.failures < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert publisher.failures >= 3
    assert (publisher.redis_ok, publisher.beats) == (False, 0)
    with EmbeddedRedis(port=port, password=PASSWORD):
        while publisher.beats < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert publisher.beats >= 1
        assert publisher.redis_ok is True
        publisher.stop()
    logs = [r for r in caplog.records if r.name == "worker_runtime.heartbeat"]
    assert [r.levelname for r in logs] == ["WARNING", "INFO"]
    assert logs[1].getMessage() == f"heartbeat to Redis at {url} works again"


def test_reader_without_redis_at_start_gives_an_empty_stale_snapshot():
    url = f"redis://127.0.0.1:{free_port()}/0"

    async def main() -> None:
        reader = ClusterStateReader(url, CLUSTER, clock=lambda: 7.0)
        try:
            snapshot = await reader.snapshot()
            assert (snapshot.workers, snapshot.taken_at, snapshot.stale) == ((), 7.0, True)
            assert (reader.redis_ok, reader.consecutive_failures) == (False, 1)
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_reader_with_no_redis_url_serves_its_static_workers():
    workers = [FakeWorker("d1")(), FakeWorker("d0")()]

    async def main() -> None:
        reader = ClusterStateReader(None, CLUSTER, static_workers=workers, clock=lambda: 3.0)
        snapshot = await reader.snapshot()
        assert snapshot.workers == (workers[1], workers[0])
        assert (snapshot.taken_at, snapshot.stale, reader.redis_ok) == (3.0, False, True)
        await reader.aclose()

    asyncio.run(main())


def test_reader_skips_a_hash_that_does_not_parse(server, publishers):
    start_publisher(publishers, server.url, FakeWorker("good"))
    client = sync_client(server.url)
    try:
        client.hset(worker_key(CLUSTER, "bad"), mapping={"worker_id": "bad", "role": "x"})
        client.sadd(workers_set_key(CLUSTER), "bad")

        async def main() -> None:
            reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0)
            try:
                await wait_for_snapshot(reader, lambda s: worker_ids(s) == ["good"], 2.0)
            finally:
                await reader.aclose()

        asyncio.run(main())
    finally:
        client.close()


SECRET = b"cluster-secret-for-tests"


def test_a_reader_holding_the_secret_takes_only_signed_heartbeats(server, publishers, caplog):
    """An attacker with write access to Redis registers a decode worker (unsigned, or signed
    with another secret), or redirects a real signed entry to its own address: the reader
    takes none of them."""
    signed = HeartbeatPublisher(server.url, CLUSTER, FakeWorker("real"), interval_s=INTERVAL_S,
                                ttl_s=1.0, secret=SECRET)
    publishers.append(signed)
    signed.start()
    client = sync_client(server.url, decode_responses=True)
    fake = dataclasses.replace(FakeWorker("fake")(), address="127.0.0.1:1", updated_at=time.time() + 60)
    other = dataclasses.replace(fake, worker_id="other-secret")
    victim = dataclasses.replace(FakeWorker("victim")(), updated_at=time.time() + 60)
    try:
        client.hset(worker_key(CLUSTER, "fake"), mapping=fake.to_hash())
        client.hset(worker_key(CLUSTER, "other-secret"), mapping=signed_hash(other, CLUSTER, b"guess"))
        client.hset(worker_key(CLUSTER, "victim"), mapping=signed_hash(victim, CLUSTER, SECRET))
        client.sadd(workers_set_key(CLUSTER), "fake", "other-secret", "victim")

        async def main() -> None:
            reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0, secret=SECRET)
            try:
                await wait_for_snapshot(reader, lambda s: worker_ids(s) == ["real", "victim"], 2.0)
                client.hset(worker_key(CLUSTER, "victim"), "address", "127.0.0.1:1")
                snapshot = await reader.snapshot()
                assert worker_ids(snapshot) == ["real"]
                assert snapshot.workers[0].address == "127.0.0.1:50051"
                assert reader.rejected_entries >= 3
            finally:
                await reader.aclose()

        with caplog.at_level(logging.WARNING, logger="router.cluster.state"):
            asyncio.run(main())
    finally:
        client.close()
    warned = sorted(r.getMessage().split("'")[1] for r in caplog.records if r.name == "router.cluster.state")
    assert warned == ["fake", "other-secret", "victim"]  # once per worker id, not once per read


def test_a_reader_without_a_secret_takes_signed_and_unsigned_heartbeats(server, publishers):
    signed = HeartbeatPublisher(server.url, CLUSTER, FakeWorker("signed"), interval_s=INTERVAL_S,
                                ttl_s=1.0, secret=SECRET)
    publishers.append(signed)
    signed.start()
    start_publisher(publishers, server.url, FakeWorker("unsigned"))

    async def main() -> None:
        reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0)
        try:
            await wait_for_snapshot(reader, lambda s: worker_ids(s) == ["signed", "unsigned"], 2.0)
            assert reader.rejected_entries == 0
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_a_heartbeat_read_again_unchanged_is_not_verified_again(server, monkeypatch):
    """Reads (every 0.1 s) outnumber heartbeats (seconds apart): a hash whose bytes are the
    same as the last read's reuses what it verified and parsed to; a changed one is verified
    again (the tampering case is test_a_reader_holding_the_secret_takes_only_signed_heartbeats)."""
    import router.cluster.state as state

    calls = []
    real = state.verified_info
    monkeypatch.setattr(state, "verified_info", lambda *a: calls.append(1) or real(*a))
    client = sync_client(server.url, decode_responses=True)
    info = dataclasses.replace(FakeWorker("w")(), updated_at=time.time() + 60)
    try:
        client.hset(worker_key(CLUSTER, "w"), mapping=signed_hash(info, CLUSTER, SECRET))
        client.sadd(workers_set_key(CLUSTER), "w")

        async def main() -> None:
            reader = ClusterStateReader(server.url, CLUSTER, max_age_s=0.0, secret=SECRET)
            try:
                first = await reader.snapshot()
                second = await reader.snapshot()
                assert worker_ids(first) == worker_ids(second) == ["w"]
                assert second.workers[0] is first.workers[0] and len(calls) == 1
                moved = dataclasses.replace(info, queued_prefill_tokens=7)
                client.hset(worker_key(CLUSTER, "w"), mapping=signed_hash(moved, CLUSTER, SECRET))
                third = await reader.snapshot()
                assert third.workers[0].queued_prefill_tokens == 7 and len(calls) == 2
            finally:
                await reader.aclose()

        asyncio.run(main())
    finally:
        client.close()
