"""The real PrefillWorker and DecodeWorker on the tiny model, linked by the in-process `local`
transfer backend, plus the few controls the state-machine and drain tests need: hold the
engine loop between two commands, hold transfer results, hold a channel opening."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader.locate import default_model_path
from engine.serving_loop import wait_until
from kv_transfer.local import LocalBackend, LocalReceiver
from kv_transfer.pool import ChannelPool
from prefill_worker.worker import DecodeTarget, PrefillWorker

BLOCK = 16


def config(model_dir, **overrides) -> EngineConfig:
    settings = dict(model=str(model_dir), tokenizer=str(default_model_path()), dtype="float32",
                    max_model_len=512, num_gpu_blocks_override=64, num_threads=1)
    settings.update(overrides)
    return EngineConfig(**settings)


def prompt(length: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((13 * i + 29 * offset) % 40000 + 200 for i in range(length))


class GatedPool(ChannelPool):
    """A ChannelPool whose poll() returns nothing while `held` (results wait, in order)."""

    def __init__(self, backend: LocalBackend) -> None:
        super().__init__(backend)
        self.held = False
        self._waiting: list = []

    def poll(self):
        self._waiting += super().poll()
        if self.held:
            return []
        out, self._waiting = self._waiting, []
        return out


class Opener:
    """Opens channels on the decode side's receiver; while `hold` is set, waits for `go`."""

    def __init__(self, receiver: LocalReceiver) -> None:
        self.receiver = receiver
        self.hold = False
        self.fail: str | None = None
        self.go = asyncio.Event()
        """Set on the asyncio loop that calls the opener."""

    async def __call__(self, address: str):
        if self.hold:
            await asyncio.wait_for(self.go.wait(), 30)
        if self.fail is not None:
            raise ConnectionError(self.fail)
        return self.receiver.open_channel()


@dataclass
class Pair:
    prefill: PrefillWorker
    decode: DecodeWorker
    pool: GatedPool
    opener: Opener
    receiver: LocalReceiver
    backend: LocalBackend

    def target(self, ticket) -> DecodeTarget:
        return DecodeTarget("decode:1", self.decode.incarnation, ticket.ticket_id, ticket.num_cached_tokens,
                            ticket.num_blocks)

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


def make_pair(model_dir, transfer_timeout_s: float = 30.0, stream_layers: bool = True, **overrides) -> Pair:
    backend = LocalBackend()
    receiver = backend.open_receiver()
    opener = Opener(receiver)
    pool = GatedPool(backend)
    prefill = PrefillWorker(EngineCore(config(model_dir, **overrides), hold_finished_blocks=True), pool, opener,
                            worker_id="prefill-t", backend_name="local", transfer_timeout_s=transfer_timeout_s,
                            stream_layers=stream_layers)
    decode = DecodeWorker(EngineCore(config(model_dir, **overrides)), receiver, worker_id="decode-t")
    prefill.start()
    decode.start()
    return Pair(prefill, decode, pool, opener, receiver, backend)


@contextmanager
def loop_held(worker) -> Iterator[None]:
    """The worker's engine loop thread waits inside a command until the block exits: commands
    submitted meanwhile run, in order, right after it and before any engine step."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    worker.loop.submit(hold)
    assert entered.wait(10), "the engine loop never ran the holding command"
    try:
        yield
    finally:
        release.set()


@contextmanager
def loop_held_when(worker, predicate) -> Iterator[threading.Event]:
    """Once `predicate()` holds at a poll of the worker's loop (after the worker's own poll
    hooks), the loop thread waits there until the block exits. Yields the event set then."""
    entered, release = threading.Event(), threading.Event()

    def hook() -> None:
        if not entered.is_set() and predicate():
            entered.set()
            release.wait(30)

    worker.loop.add_poll_hook(hook)
    try:
        yield entered
    finally:
        release.set()


def record_of(worker, request_id: str, timeout: float = 10.0):
    """The live record of `request_id` (waits for it to appear)."""
    found: list = []

    def look() -> bool:
        found[:] = [r for r in worker.records() if r.request_id == request_id]
        return bool(found)

    assert wait_until(look, timeout), f"{request_id} never reached {worker.worker_id}"
    return found[0]


def assert_idle(worker) -> None:
    """Nothing in flight, no record, no block held, reserved or used."""
    assert wait_until(lambda: worker.in_flight == 0, 10.0), worker.records()
    stats = worker.loop.submit(worker.core.stats).result(10)
    assert (stats.free_blocks, stats.reserved_blocks) == (stats.total_blocks, 0), stats
    assert (stats.num_running, stats.num_waiting, stats.num_reserved) == (0, 0, 0), stats
    assert not worker.core.scheduler.held
    assert worker.records() == ()
