"""The router's admission queue: FIFO, bounded by count and time, Retry-After from the free rate."""

from __future__ import annotations

import asyncio

import pytest

from router.routing.admission import AdmissionQueue, AdmissionSettings, FreeRate
from router.routing.cluster_backend import check_fits_capacity
from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.errors import InvalidRequest, Overloaded


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Room:
    """Decode room as a count of admissions still possible; attempts are recorded in order."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.attempts: list[str] = []

    def attempt(self, name: str):
        async def run() -> str | None:
            self.attempts.append(name)
            if self.free > 0:
                self.free -= 1
                return name
            return None

        return run


def run(coro):
    return asyncio.run(coro)


def test_request_is_admitted_at_once_when_there_is_room():
    async def main():
        queue = AdmissionQueue(AdmissionSettings())
        room = Room(free=1)
        assert await queue.admit(room.attempt("a"), blocks=4) == ("a", 0.0)
        assert queue.num_waiting == 0

    run(main())


def test_waiting_requests_are_admitted_in_arrival_order_when_blocks_are_freed():
    async def main():
        queue = AdmissionQueue(AdmissionSettings(poll_interval_s=10.0))
        room = Room(free=0)
        tasks = [asyncio.ensure_future(queue.admit(room.attempt(name), blocks=b))
                 for name, b in (("long", 60), ("short1", 1), ("short2", 1))]
        await asyncio.sleep(0.01)
        assert queue.num_waiting == 3
        assert queue.blocks_waiting() == 62
        admitted = []
        for _ in range(3):
            room.free += 1
            queue.blocks_freed(8)
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                admitted.append(task.result()[0])
                tasks.remove(task)
        assert admitted == ["long", "short1", "short2"]
        # Only the head of the queue ever tried: nobody behind it overtook it.
        runs = [a for i, a in enumerate(room.attempts) if i == 0 or a != room.attempts[i - 1]]
        assert runs == ["long", "short1", "short2"]
        assert queue.num_waiting == 0

    run(main())


def test_new_arrival_waits_behind_the_queue_even_if_it_would_fit():
    async def main():
        queue = AdmissionQueue(AdmissionSettings(poll_interval_s=10.0))
        room = Room(free=0)
        head = asyncio.ensure_future(queue.admit(room.attempt("head"), blocks=50))
        await asyncio.sleep(0.01)
        room.free = 1  # room appears, but nobody signalled yet
        late = asyncio.ensure_future(queue.admit(room.attempt("late"), blocks=1))
        await asyncio.sleep(0.01)
        assert not late.done() and queue.num_waiting == 2
        queue.blocks_freed(1)
        assert (await head)[0] == "head"
        room.free = 1
        queue.blocks_freed(1)
        assert (await late)[0] == "late"

    run(main())


def test_full_queue_refuses_at_once_with_503_and_retry_after():
    async def main():
        queue = AdmissionQueue(AdmissionSettings(max_queued=1, poll_interval_s=10.0))
        room = Room(free=0)
        waiting = asyncio.ensure_future(queue.admit(room.attempt("a"), blocks=10))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as info:
            await queue.admit(room.attempt("b"), blocks=5)
        assert info.value.retry_after_seconds == 60  # nothing was freed yet: the upper bound
        assert "admission queue is full (1 waiting)" in info.value.message
        assert queue.rejections == {"queue_full": 1}
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert queue.num_waiting == 0

    run(main())


def test_wait_longer_than_the_bound_is_refused_with_503():
    async def main():
        queue = AdmissionQueue(AdmissionSettings(max_wait_s=0.05, poll_interval_s=0.01))
        room = Room(free=0)
        with pytest.raises(Overloaded) as info:
            await queue.admit(room.attempt("a"), blocks=3)
        assert info.value.message.startswith("no decode worker had room for 3 KV blocks within 0.05 s")
        assert queue.rejections == {"queue_timeout": 1}
        assert queue.num_waiting == 0
        assert len(room.attempts) >= 3  # the head polled while it waited

    run(main())


def test_zero_queue_refuses_at_once_when_there_is_no_room():
    async def main():
        queue = AdmissionQueue(AdmissionSettings(max_queued=0))
        with pytest.raises(Overloaded):
            await queue.admit(Room(free=0).attempt("a"), blocks=1)

    run(main())


def test_an_error_from_an_attempt_propagates_and_frees_the_head():
    async def main():
        queue = AdmissionQueue(AdmissionSettings(poll_interval_s=10.0))

        async def broken():
            raise InvalidRequest("bad")

        room = Room(free=0)
        first = asyncio.ensure_future(queue.admit(room.attempt("first"), blocks=1))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(queue.admit(broken, blocks=1))
        await asyncio.sleep(0.01)
        room.free = 1
        queue.blocks_freed(1)
        assert (await first)[0] == "first"
        with pytest.raises(InvalidRequest):
            await second
        assert queue.num_waiting == 0

    run(main())


def test_retry_after_is_blocks_needed_over_the_recent_free_rate():
    clock = FakeClock()
    rate = FreeRate(window_s=10.0, clock=clock)
    clock.now += 10.0
    for _ in range(5):
        rate.record(20)  # 100 blocks in the last 10 s
    assert rate.per_second() == 10.0
    assert rate.retry_after_s(35) == 3.5
    assert rate.retry_after_s(1) == 1.0  # never below 1 s
    assert rate.retry_after_s(10_000) == 60.0  # never above 60 s
    clock.now += 11.0  # the frees fall out of the window
    assert rate.per_second() == 0.0
    assert rate.retry_after_s(1) == 60.0


def test_settings_reject_nonsense():
    with pytest.raises(ValueError, match="max_queued must be >= 0"):
        AdmissionSettings(max_queued=-1)
    with pytest.raises(ValueError, match="max_wait_s must be > 0"):
        AdmissionSettings(max_wait_s=0)


def _decode(worker_id: str, total_blocks: int, block_size: int = 16) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1", metrics_address="",
                      incarnation="i", block_size=block_size, total_blocks=total_blocks,
                      free_blocks=total_blocks, reserved_blocks=0, cached_blocks=0, num_running=0,
                      num_waiting=0, queued_prefill_tokens=0, max_model_len=8192, updated_at=1.0)


def test_request_larger_than_every_decode_worker_is_refused_with_the_numbers():
    snapshot = ClusterSnapshot((_decode("d0", 32), _decode("d1", 64)), taken_at=0.0, stale=False)
    check_fits_capacity(1000, 24, snapshot)  # 1024 tokens: exactly d1's cache
    with pytest.raises(InvalidRequest) as info:
        check_fits_capacity(1000, 25, snapshot)
    assert info.value.message == (
        "This request needs 1,025 tokens of KV cache (1,000 prompt + 25 max_tokens), but the "
        "largest decode worker holds 1,024 tokens (64 blocks x 16). Reduce the prompt or max_tokens."
    )
    assert info.value.param == "max_tokens"


def test_capacity_check_passes_without_decode_workers():
    check_fits_capacity(10**6, 10**6, ClusterSnapshot((), taken_at=0.0, stale=False))
