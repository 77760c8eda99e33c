"""The real DecodeWorker (tiny model, `local` receiver): a caller that leaves while its
reservation is being made gets no ticket, and the reservation is freed at once rather than at
the ticket's deadline (which the worker also clamps)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader.locate import default_model_path
from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from kv_transfer.local import LocalBackend

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def worker(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), tokenizer=str(default_model_path()), dtype="float32",
                       max_model_len=512, num_gpu_blocks_override=64, num_threads=1)
    w = DecodeWorker(EngineCore(cfg), LocalBackend().open_receiver())
    w.start()
    yield w
    w.stop()


def test_a_reservation_whose_caller_left_during_it_is_freed_at_once(worker):
    started, release = threading.Event(), threading.Event()
    reserve = worker.core.reserve_remote

    def slow_reserve(request):
        started.set()
        release.wait(10)
        return reserve(request)

    worker.core.reserve_remote = slow_reserve

    async def leave_mid_reservation():
        task = asyncio.create_task(worker.admit("gone", tuple(range(200, 250)), PARAMS, ticket_timeout_s=60.0))
        assert await asyncio.to_thread(started.wait, 10)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_mid_reservation())
    assert wait_until(lambda: worker.status().core.reserved_blocks == 0 and worker.in_flight == 0, 5.0), (
        worker.status(), worker.records())
    stats = worker.core.stats()
    assert (stats.free_blocks, stats.reserved_blocks, stats.num_running) == (stats.total_blocks, 0, 0)
