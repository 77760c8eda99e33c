"""A real EngineCore on its ServingLoop publishes its prefix-cache blocks through an embedded
Redis; the router's reader indexes them and route_request finds the prompt's cached blocks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader.locate import default_model_path
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.serving_loop import ServingLoop
from worker_runtime.kv_events import KVEventPublisher
from pdserve.redis_server import EmbeddedRedis
from router.cluster.redis_settings import RedisAuth
from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.cluster.kv_event_reader import KVEventReader

pytestmark = pytest.mark.timeout(120)

PROMPT = tuple((11 * i) % 40000 + 200 for i in range(70))  # 4 full blocks of 16, and 6 tokens


def info(core: EngineCore, incarnation: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id="d0", role="decode", address="127.0.0.1:1", metrics_address="",
        incarnation=incarnation, block_size=core.config.block_size, total_blocks=64,
        free_blocks=64, reserved_blocks=0, cached_blocks=0, num_running=0, num_waiting=0,
        queued_prefill_tokens=0, max_model_len=512, updated_at=time.time(),
    )  # fmt: skip


def test_a_served_prompt_is_found_cached_on_its_worker_by_the_router(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir), tokenizer=str(default_model_path()), dtype="float32",
        max_model_len=512, num_gpu_blocks_override=64, num_threads=1,
    )  # fmt: skip
    core = EngineCore(config)
    loop = ServingLoop(core)
    loop.start()
    done = threading.Event()
    with EmbeddedRedis() as server:
        auth = RedisAuth(password=server.password)
        publisher = KVEventPublisher(
            server.url, "test", "d0", "inc-1", core.take_block_events, core.cached_block_hashes, auth=auth
        )
        try:
            loop.add_poll_hook(publisher.poll)
            publisher.start()
            request = Request("r0", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

            def add() -> None:
                loop.attach("r0", lambda out: done.set() if out.finish_reason else None)
                core.add_request(request)

            loop.submit(add).result(timeout=10)
            assert done.wait(60), "the request did not finish"

            async def main() -> None:
                reader = KVEventReader(server.url, "test", block_ms=100, auth=auth)
                reader.start()
                snapshot = ClusterSnapshot(workers=(info(core, "inc-1"),), taken_at=1.0, stale=False)
                try:
                    deadline = time.monotonic() + 10
                    while len(reader.index.blocks_of("d0")) < 4 and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    cached = frozenset(loop.submit(core.cached_block_hashes).result(timeout=5))
                    assert reader.index.blocks_of("d0") == cached
                    route = reader.route_request(list(PROMPT), 8, snapshot)
                    assert route.cached_blocks == (("d0", 4),)
                    assert route.num_prompt_tokens == 70
                finally:
                    await reader.aclose()

            asyncio.run(main())
        finally:
            publisher.stop()
            loop.stop()
    assert core.stats().num_running == 0
