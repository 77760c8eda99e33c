"""The real PrefillWorker (tiny model, in-process `local` transfers): clients that leave while
their KV is in flight must not stop the others' prefills from completing, and no block is
held afterwards. Transfer results are held back by a gate so that cancelled and live requests
are settled in the same poll, deterministically (the hang of issue 10, item 1)."""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader.locate import default_model_path
from engine.sampling_params import SamplingParams
from engine.serving_loop import wait_until
from kv_transfer.local import LocalBackend
from kv_transfer.pool import ChannelPool
from prefill_worker.worker import DecodeTarget, PrefillResult, PrefillState, PrefillWorker

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16


class GatedPool(ChannelPool):
    """A ChannelPool whose poll() returns nothing until the gate opens, then everything at once."""

    def __init__(self, backend: LocalBackend) -> None:
        super().__init__(backend)
        self.open = False
        self._held: list = []

    def poll(self):
        self._held += super().poll()
        if not self.open:
            return []
        held, self._held = self._held, []
        return held


def _prompt(length: int, offset: int) -> tuple[int, ...]:
    return tuple((13 * i + 29 * offset) % 40000 + 200 for i in range(length))


@pytest.fixture()
def worker(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), tokenizer=str(default_model_path()), dtype="float32",
                       max_model_len=512, num_gpu_blocks_override=64, num_threads=1)
    backend = LocalBackend()
    receiver = backend.open_receiver()

    async def opener(_: str):
        return receiver.open_channel()

    w = PrefillWorker(EngineCore(cfg, hold_finished_blocks=True), GatedPool(backend), opener,
                      backend_name="local")
    w.start()
    yield w, receiver
    w.stop()


def _target(ticket_id: int, prompt: tuple[int, ...]) -> DecodeTarget:
    return DecodeTarget("decode:1", "inc-1", ticket_id, 0, -(-len(prompt) // BLOCK))


def _sending(w: PrefillWorker) -> int:
    return sum(r.state is PrefillState.SENDING for r in w.records())


async def _storm(w: PrefillWorker, prompts: list[tuple[int, ...]], cancel: set[int]):
    tasks = [asyncio.create_task(w.prefill(f"r{i}", p, PARAMS, _target(100 + i, p)))
             for i, p in enumerate(prompts)]
    in_flight = await asyncio.to_thread(wait_until, lambda: _sending(w) == len(prompts), 30.0)
    assert in_flight, f"only {_sending(w)} of {len(prompts)} transfers were queued"
    for i in sorted(cancel):
        tasks[i].cancel()
    done, _ = await asyncio.wait([tasks[i] for i in cancel], timeout=10)
    assert len(done) == len(cancel)
    w.channels.open = True
    kept = [tasks[i] for i in range(len(prompts)) if i not in cancel]
    return await asyncio.wait_for(asyncio.gather(*kept), timeout=10)


def test_prefills_complete_when_clients_before_them_leave_mid_transfer(worker):
    w, receiver = worker
    prompts = [_prompt(20 + 7 * i, i) for i in range(6)]
    cancel = {0, 2, 3}  # the first result in the batch belongs to a departed client
    results = asyncio.run(_storm(w, prompts, cancel))
    assert [type(r) for r in results] == [PrefillResult] * 3
    assert [r.num_blocks for r in results] == [-(-len(prompts[i]) // BLOCK) for i in (1, 4, 5)]
    assert sorted(kv.header.ticket_id for kv in receiver.poll()) == [100, 101, 102, 103, 104, 105]
    assert wait_until(lambda: w.in_flight == 0, 5.0)
    stats = w.core.stats()
    assert (stats.free_blocks, stats.num_running, stats.num_waiting) == (stats.total_blocks, 0, 0)
    assert not w.core.scheduler.held
    assert w.status().transfers.count == 6
