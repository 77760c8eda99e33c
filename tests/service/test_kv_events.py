"""Block events through a real (embedded) Redis: a worker's real BlockPool -> KVEventPublisher ->
the stream -> KVEventReader -> PrefixIndex, including restarts of the router, the worker and Redis."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

import pytest

from engine.kv_cache.block_pool import BlockEvents, BlockPool
from engine.kv_cache.hashing import hash_full_blocks
from worker_runtime.kv_events import KVEventPublisher, order_events
from pdserve.redis_server import EmbeddedRedis, free_port
from router.cluster.redis_settings import PASSWORD_ENV, sync_client
from router.cluster.keys import kv_events_key
from router.cluster.kv_event_reader import KVEventReader

pytestmark = pytest.mark.timeout(60)

PASSWORD = "service-test-password"
"""Every embedded Redis here (restarts included) has it; clients find it in the environment."""


@pytest.fixture(autouse=True)
def redis_password_in_env(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)

CLUSTER = "test"
BS = 4  # tokens per block
T = TypeVar("T")


class PoolLoop:
    """A real BlockPool owned by one thread that runs commands, then poll hooks, every few ms:
    the ServingLoop's contract (engine/serving_loop.py) without a model."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._hooks: list[Callable[[], object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._commands.get(timeout=0.005)()
            except queue.Empty:
                pass
            for hook in self._hooks:
                hook()

    def run(self, fn: Callable[[], T]) -> T:
        """fn() on the loop thread; blocks for its result."""
        future: Future[T] = Future()
        self._commands.put(lambda: future.set_result(fn()))
        return future.result(timeout=5)

    def add_poll_hook(self, hook: Callable[[], object]) -> None:
        self.run(lambda: self._hooks.append(hook))

    def cache(self, token_ids: list[int]) -> list[bytes]:
        """Compute-and-free a prompt's full blocks: they stay cached (evictable LRU)."""

        def command() -> list[bytes]:
            hashes = hash_full_blocks(token_ids, BS)
            blocks = self.pool.get_new_blocks(len(hashes))
            assert blocks is not None, "test pool too small"
            for block, block_hash in zip(blocks, hashes):
                self.pool.cache(block, block_hash)
            self.pool.free(reversed(blocks))  # as requests free them: tail evicted first
            return hashes

        return self.run(command)

    def cached(self) -> frozenset[bytes]:
        return frozenset(self.run(self.pool.cached_hashes))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded


@pytest.fixture
def cleanup() -> Iterator[list]:
    """Publishers and loops a test starts; stopped at teardown even if the test fails."""
    started: list = []
    yield started
    for thing in reversed(started):
        thing.stop()


def publisher_for(
    cleanup: list, url: str, loop: PoolLoop, incarnation: str = "inc-1", start: bool = True, **kw
) -> KVEventPublisher:
    publisher = KVEventPublisher(
        url, CLUSTER, "w0", incarnation, loop.pool.take_events, loop.pool.cached_hashes,
        retry_interval_s=0.1, check_interval_s=0.2, **kw,
    )  # fmt: skip
    cleanup.append(publisher)
    if start:
        loop.add_poll_hook(publisher.poll)
        publisher.start()
    return publisher


def new_loop(cleanup: list, num_blocks: int = 16) -> PoolLoop:
    loop = PoolLoop(num_blocks)
    cleanup.append(loop)
    return loop


def new_reader(url: str) -> KVEventReader:
    return KVEventReader(url, CLUSTER, block_ms=100, backoff_min_s=0.05, backoff_max_s=0.2)


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s")
        await asyncio.sleep(0.02)


def stream_kinds(url: str) -> list[tuple[str, int]]:
    client = sync_client(url)
    try:
        return [
            (fields[b"kind"].decode(), len(fields[b"hashes"]) // 32)
            for _, fields in client.xrange(kv_events_key(CLUSTER))
        ]
    finally:
        client.close()


def test_the_index_holds_exactly_what_the_worker_caches_and_forgets_what_it_evicts(
    server, cleanup
):
    loop = new_loop(cleanup, num_blocks=8)
    a = loop.cache(prompt(0, 4))
    publisher_for(cleanup, server.url, loop)

    async def main() -> None:
        reader = new_reader(server.url)
        reader.start()
        try:
            await eventually(lambda: reader.index.blocks_of("w0") == frozenset(a))
            assert reader.index.match(a) == {"w0": 4}
            # 6 new blocks from 8: the 4 free ones, then a's tail (blocks 3 and 2) is evicted.
            b = loop.cache(prompt(1000, 6))
            await eventually(lambda: reader.index.blocks_of("w0") == loop.cached())
            assert reader.index.blocks_of("w0") == frozenset(a[:2] + b)
            assert reader.index.match(a) == {"w0": 2}
            assert reader.index.match(b) == {"w0": 6}
            assert (reader.snapshot_events, reader.caught_up, reader.malformed) == (1, True, 0)
        finally:
            await reader.aclose()

    asyncio.run(main())
    assert stream_kinds(server.url) == [("snapshot", 4), ("evicted", 2), ("stored", 6)]


def test_a_restarted_router_rebuilds_the_index_from_the_stream(server, cleanup):
    loop = new_loop(cleanup)
    publisher_for(cleanup, server.url, loop)
    a = loop.cache(prompt(0, 3))
    b = loop.cache(prompt(500, 2))

    async def main() -> None:
        first = new_reader(server.url)
        first.start()
        await eventually(lambda: first.index.blocks_of("w0") == frozenset(a + b))
        await first.aclose()
        second = new_reader(server.url)  # a new router: empty index, reads from "0"
        try:
            while await second.read_once():
                pass
            assert second.index.blocks_of("w0") == frozenset(a + b)
            assert (second.index.match(a), second.index.match(b)) == ({"w0": 3}, {"w0": 2})
            assert second.events_applied == first.events_applied
        finally:
            await second.aclose()

    asyncio.run(main())


def test_a_new_incarnation_replaces_the_old_ones_entries_and_fences_its_late_events(
    server, cleanup
):
    old_loop, new_loop_ = new_loop(cleanup), new_loop(cleanup)
    a = old_loop.cache(prompt(0, 3))
    publisher_for(cleanup, server.url, old_loop, incarnation="old")
    b = new_loop_.cache(prompt(700, 2))

    async def main() -> None:
        reader = new_reader(server.url)
        reader.start()
        try:
            await eventually(lambda: reader.index.blocks_of("w0") == frozenset(a))
            publisher_for(cleanup, server.url, new_loop_, incarnation="new")  # w0 restarted
            await eventually(lambda: reader.index.workers() == {"w0": "new"})
            assert reader.index.blocks_of("w0") == frozenset(b)
            old_loop.cache(prompt(300, 1))  # the old run, still writing
            await eventually(lambda: reader.events_dropped == 1)
            assert reader.index.blocks_of("w0") == frozenset(b)
            assert reader.index.match(a) == {}
        finally:
            await reader.aclose()

    asyncio.run(main())


def test_after_redis_restarts_the_worker_republishes_a_snapshot_and_the_index_catches_up(
    cleanup, caplog
):
    caplog.set_level(logging.INFO)
    port = free_port()
    first = EmbeddedRedis(port=port, password=PASSWORD).start()
    second: EmbeddedRedis | None = None
    seen: list[logging.LogRecord] = []  # the logs up to the catch-up, not the teardown's
    loop = new_loop(cleanup, num_blocks=8)
    a = loop.cache(prompt(0, 4))
    publisher = publisher_for(cleanup, first.url, loop)

    async def main() -> None:
        nonlocal second
        reader = new_reader(first.url)
        reader.start()
        try:
            await eventually(lambda: reader.index.blocks_of("w0") == frozenset(a))
            first.kill()
            loop.cache(prompt(2000, 2))  # its events fail to publish: Redis is down
            await eventually(lambda: not publisher.redis_ok and not reader.redis_ok)
            loop.cache(prompt(3000, 3))  # dropped at once while down
            assert reader.index.blocks_of("w0") == frozenset(a)  # kept through the outage
            second = EmbeddedRedis(port=port, password=PASSWORD).start()  # empty: no stream, no history
            await eventually(lambda: reader.index.blocks_of("w0") == loop.cached())
            assert len(loop.cached()) == 8
            assert reader.redis_ok and publisher.redis_ok
            # Read now: once the servers stop below, a publish still running fails and warns.
            seen.extend(caplog.records)
        finally:
            await reader.aclose()

    try:
        asyncio.run(main())
    finally:
        first.stop()
        if second is not None:
            second.stop()
    publisher_logs = [r for r in seen if r.name == "worker_runtime.kv_events"]
    assert [r.levelname for r in publisher_logs] == ["WARNING", "INFO"]
    assert publisher_logs[1].getMessage() == (
        f"block events to Redis at {first.url} work again; publishing a snapshot"
    )
    reader_logs = [r for r in seen if r.name == "router.cluster.kv_event_reader"]
    assert [r.levelname for r in reader_logs if r.levelno >= logging.WARNING] == ["WARNING"]
    assert reader_logs[-1].getMessage().startswith(
        f"block events from Redis at {first.url} readable again after "
    )


def test_redis_down_at_start_never_blocks_the_engine_loop_and_queues_nothing(cleanup, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    loop = new_loop(cleanup)
    publisher = publisher_for(cleanup, url, loop)
    deadline = time.monotonic() + 5
    while publisher.redis_ok and time.monotonic() < deadline:
        time.sleep(0.02)
    assert publisher.redis_ok is False
    started = time.monotonic()
    hashes = loop.cache(prompt(0, 5))
    loop.run(lambda: None)  # one more iteration: the poll hook has seen the events
    assert time.monotonic() - started < 0.5
    assert publisher.dropped_hashes == 5
    assert loop.run(lambda: loop.pool.take_events()) == BlockEvents((), ())  # drained
    with EmbeddedRedis(port=port, password=PASSWORD):

        async def main() -> None:
            reader = new_reader(url)
            reader.start()
            try:
                await eventually(lambda: reader.index.blocks_of("w0") == frozenset(hashes))
            finally:
                await reader.aclose()

        asyncio.run(main())
        publisher.stop()
    levels = [r.levelname for r in caplog.records if r.name == "worker_runtime.kv_events"]
    assert levels == ["WARNING", "INFO"]


def test_a_large_snapshot_spans_entries_and_replaces_in_full(server, cleanup):
    loop = new_loop(cleanup)
    hashes = loop.cache(prompt(0, 7))
    publisher_for(cleanup, server.url, loop, max_hashes_per_entry=3)

    async def main() -> None:
        reader = new_reader(server.url)
        reader.start()
        try:
            await eventually(lambda: reader.index.blocks_of("w0") == frozenset(hashes))
        finally:
            await reader.aclose()

    asyncio.run(main())
    assert stream_kinds(server.url) == [("snapshot", 3), ("stored", 3), ("stored", 1)]


def test_an_overflowing_queue_is_replaced_by_one_snapshot(server, cleanup):
    loop = new_loop(cleanup)
    publisher = publisher_for(cleanup, server.url, loop, start=False, max_queued_hashes=4)
    loop.cache(prompt(0, 3))
    loop.run(publisher.poll)  # 3 queued
    loop.cache(prompt(100, 3))
    loop.run(publisher.poll)  # 6 > 4: dropped, a snapshot asked for
    assert publisher.dropped_hashes == 6
    loop.run(publisher.poll)  # the snapshot: all 6 cached hashes
    publisher.start()
    deadline = time.monotonic() + 5
    while publisher.snapshots < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream_kinds(server.url) == [("snapshot", 6)]


def test_a_clean_stop_publishes_an_empty_snapshot(server, cleanup):
    loop = new_loop(cleanup)
    loop.cache(prompt(0, 2))
    publisher = publisher_for(cleanup, server.url, loop)
    deadline = time.monotonic() + 5
    while publisher.snapshots < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    publisher.stop()
    assert stream_kinds(server.url) == [("snapshot", 2), ("snapshot", 0)]


def test_a_hash_both_stored_and_evicted_in_one_step_ends_as_the_cache_holds_it():
    h = hash_full_blocks(prompt(0, 2), BS)
    events = BlockEvents(stored=(h[0], h[1]), evicted=(h[1],))
    assert order_events(events, lambda: [h[0], h[1]]) == ((), (h[0], h[1]))
    assert order_events(events, lambda: [h[0]]) == ((h[1],), (h[0],))

    def never() -> list[bytes]:
        raise AssertionError("the cache is read only to resolve a hash in both lists")

    assert order_events(BlockEvents((h[0],), (h[1],)), never) == ((h[1],), (h[0],))
