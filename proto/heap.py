"""The garbage collector's settings of a serving process (router and workers alike).

CPython's cyclic collector walks every tracked container object in a full (oldest-generation)
collection, holding the GIL throughout. What a process builds at start-up is never garbage: the
router's app and modules; a worker's model modules, its tokenizer's vocabulary and the merge
tables (about 300,000 tracked objects with SmolLM2). In a worker process one full collection
took 120-137 ms on this project's 2-core EPYC, and while it ran neither the engine loop nor the
asyncio loop could hand a token on: tokens sampled just before waited that long to leave.
vLLM's engine core freezes its start-up heap for the same reason.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

GC_GEN0_THRESHOLD = 20_000
"""Allocations between young-generation collections (CPython's default: 700). A streamed
request allocates a few thousand short-lived objects (protobufs, dicts, frames); at 700 the
collector ran several times per request and took ~5% of the router's CPU under
benchmarks/router_overhead.py. The objects die young either way: only the pauses get fewer."""


def settle_heap() -> int:
    """Collect once, move what start-up built out of the collector's view for good (gc.freeze),
    and collect the young generation less often. Call once, when start-up is done and before
    serving. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
    frozen = gc.get_freeze_count()
    logger.info("heap settled: %d start-up objects frozen out of the garbage collector's view", frozen)
    return frozen
