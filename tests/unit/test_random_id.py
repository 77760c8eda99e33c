"""Request ids: 32 hex digits, never repeated, drawn ahead from the OS, and not inherited by a
forked child (which would hand out its parent's next ids)."""

from __future__ import annotations

import os

from router.serving import types
from router.serving.types import random_id


def test_random_ids_are_32_hex_digits_and_distinct_across_refills():
    ids = [random_id() for _ in range(3 * types._IDS_PER_READ + 5)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in ids)


def test_a_forked_child_does_not_hand_out_its_parents_next_ids():
    random_id()  # the pool holds ids read ahead now
    assert types._ids
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id and whether it started with an empty pool
        os.close(read)
        os.write(write, f"{len(types._ids)} {random_id()}".encode())
        os._exit(0)
    os.close(write)
    try:
        left_in_child, child_id = os.read(read, 100).decode().split()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert left_in_child == "0"
    assert child_id not in types._ids and child_id != random_id()
