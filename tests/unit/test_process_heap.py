"""Router and worker processes settle their heap once serving starts: start-up objects frozen out
of the collector's view, young collections every GC_GEN0_THRESHOLD allocations (proto/heap.py)."""

import gc

from proto.heap import GC_GEN0_THRESHOLD, settle_heap


def test_settle_heap_freezes_start_up_objects_and_raises_only_the_young_generation_threshold():
    before = gc.get_threshold()
    try:
        assert settle_heap() > 0  # how many it froze (frozen objects can be freed right after: no equality)
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
