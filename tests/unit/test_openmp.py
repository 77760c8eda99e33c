"""A worker keeps one OpenMP pool: the build's helpers end with its thread, other threads ask
for one OpenMP thread (engine.openmp)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.openmp import _libgomp, build_on_passing_thread, one_openmp_thread_here

pytestmark = pytest.mark.skipif(_libgomp() is None, reason="torch here has no libgomp")


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _on_a_thread(fn):
    """fn() on a thread of its own, so this test leaves the main thread's OpenMP setting alone."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and out, "the thread did not finish"
    return out[0]


def _parallel_work() -> None:
    """A region of two threads: torch's count applied to this thread first, then two asked for."""
    torch.get_num_threads()
    _libgomp().omp_set_num_threads(2)
    assert torch.get_num_threads() == 2
    torch.ones(1 << 22).mul_(2).sum()  # large enough for torch to split across the team


def test_the_builds_openmp_helpers_end_with_its_thread():
    during: list[set[str]] = []

    def build() -> str:
        _parallel_work()
        during.append(_tasks())
        return "built"

    def call() -> tuple[str, int, set[str], set[str]]:
        """On the caller's thread, which stays alive (a pool it owned would stay with it)."""
        before = _tasks()
        built = build_on_passing_thread(build)
        started = during[0] - before
        deadline = time.monotonic() + 10
        while started & _tasks() and time.monotonic() < deadline:
            time.sleep(0.02)
        return built, torch.get_num_threads(), started, started & _tasks()

    built, threads, started, left = _on_a_thread(call)
    assert (built, threads) == ("built", 1)  # the caller is kept to one OpenMP thread
    assert len(started) >= 2, "the build thread and at least one OpenMP helper"
    assert left == set(), "the build's OpenMP helpers outlived it"


def test_the_builds_error_is_raised_to_the_caller():
    def build():
        raise ValueError("no weights")

    def call() -> str:
        with pytest.raises(ValueError, match="no weights"):
            build_on_passing_thread(build)
        return "raised"

    assert _on_a_thread(call) == "raised"


def test_one_openmp_thread_here_starts_no_helpers_and_leaves_other_threads_alone():
    main_threads = torch.get_num_threads()

    def work() -> tuple[int, set[str]]:
        before = _tasks()
        one_openmp_thread_here()
        torch.ones(1 << 22).mul_(2).sum()
        return torch.get_num_threads(), _tasks() - before

    threads, started = _on_a_thread(work)
    assert (threads, started) == (1, set())
    assert torch.get_num_threads() == main_threads
