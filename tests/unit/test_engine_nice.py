"""The engine loop thread runs below the threads that stream tokens (EngineConfig.engine_nice)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.thread_priority import ENGINE_NICE_CPU, engine_nice_for, lower_thread_priority, start_at_process_priority
from engine.serving_loop import ServingLoop
from tests.tiny_model import tiny_llm, write_tiny_model

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return result[0]


def test_default_is_lower_on_cpu_and_off_on_a_gpu():
    assert engine_nice_for(None, torch.device("cpu")) == ENGINE_NICE_CPU == 10
    assert engine_nice_for(None, torch.device("cuda")) == 0
    assert engine_nice_for(0, torch.device("cpu")) == 0
    assert engine_nice_for(4, torch.device("cuda")) == 4


@pytest.mark.parametrize("bad", [-1, 20])
def test_out_of_range_is_refused_naming_the_setting(bad):
    with pytest.raises(ValueError, match=rf"engine_nice must be 0\.\.19 \(nice steps below the process\), got {bad}"):
        EngineConfig(engine_nice=bad)


@linux_only
def test_only_the_calling_thread_and_the_threads_it_starts_are_lowered():
    base = _nice()

    def lowered():
        got = lower_thread_priority(3)
        return got, _nice(), _in_thread(_nice)

    got, own, child = _in_thread(lowered)
    assert got == own == child == min(base + 3, 19)
    assert _nice() == base  # the rest of the process is untouched
    assert _in_thread(lambda: lower_thread_priority(0)) is None
    assert _in_thread(lambda: lower_thread_priority(50)) == 19  # capped, never an error


@linux_only
def test_the_serving_loop_steps_at_the_configured_nice(tmp_path: Path):
    base = _nice()
    llm = tiny_llm(write_tiny_model(tmp_path / "tiny"), engine_nice=4)
    loop = ServingLoop(llm.engine.core)
    loop.start()
    try:
        assert loop.submit(_nice).result(timeout=30) == min(base + 4, 19)
    finally:
        loop.stop()
    assert _nice() == base


@linux_only
def test_a_lowered_thread_starts_token_threads_at_the_process_priority():
    """A thread inherits its creator's nice and cannot raise it back without privilege: the
    starter thread (made before the first lowering) starts them instead."""
    base = _nice()

    def lowered():
        lower_thread_priority(5)
        plain = _in_thread(_nice)
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(_nice()))
        start_at_process_priority(thread)
        thread.join(10)
        return plain, seen[0]

    plain, started = _in_thread(lowered)
    assert plain == min(base + 5, 19)
    assert started == base
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(_nice()))
    start_at_process_priority(thread)  # from a thread at the process's priority: started directly
    thread.join(10)
    assert seen == [base]


@linux_only
def test_a_thread_that_fails_to_start_raises_in_the_caller():
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join(10)

    def lowered():
        lower_thread_priority(2)
        try:
            start_at_process_priority(thread)  # a thread can only be started once
        except RuntimeError as exc:
            return str(exc)
        return None

    assert "threads can only be started once" in _in_thread(lowered)


@linux_only
def test_a_forked_child_makes_its_own_starter():
    """The starter thread does not survive a fork: the child's first lowering makes a new one
    instead of waiting on a thread that is not there."""

    def lowered():
        lower_thread_priority(1)  # the parent's starter exists from here on
        return True

    assert _in_thread(lowered)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if a lowered thread's start works
        code = 1
        try:
            base = _nice()

            def child_lowered():
                lower_thread_priority(2)
                seen: list[int] = []
                thread = threading.Thread(target=lambda: seen.append(_nice()))
                start_at_process_priority(thread)
                thread.join(5)
                return seen == [base]

            code = 0 if _in_thread(child_lowered) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
