"""The engine loop thread runs below the threads that stream tokens (EngineConfig.engine_nice)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.device import ENGINE_NICE_CPU, engine_nice_for, lower_thread_priority
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
