"""Decode steps of a few tokens can run on fewer intra-op threads than prefill (engine.device.StepThreads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.device import StepThreads
from tests.tiny_model import tiny_llm, write_tiny_model


def test_small_steps_get_the_decode_threads_and_larger_ones_every_thread():
    assert StepThreads.resolve(threads=2, decode_threads=None) == StepThreads(full=2, small=2)  # default
    threads = StepThreads.resolve(threads=2, decode_threads=1)
    assert threads == StepThreads(full=2, small=1, small_tokens=4)
    assert [threads.for_step(n) for n in (1, 4, 5, 2048)] == [1, 1, 2, 2]
    assert StepThreads.resolve(threads=1, decode_threads=3).small == 1  # never more than num_threads
    with pytest.raises(ValueError, match="threads must be positive, got full=0, small=1"):
        StepThreads(full=0, small=1)


def test_the_runner_switches_threads_when_the_kind_of_step_changes(tmp_path: Path):
    before = torch.get_num_threads()
    try:
        llm = tiny_llm(write_tiny_model(tmp_path / "tiny"), num_threads=2, decode_threads=1,
                       enable_prefix_caching=False)
        engine = llm.engine
        engine.add_request("a", list(range(100, 120)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        seen = []
        while engine.has_unfinished_requests():
            engine.step()
            seen.append(torch.get_num_threads())
        assert seen == [2, 1, 1]  # the 20-token prefill on 2 threads, then decodes of 1 token on 1
    finally:
        torch.set_num_threads(before)
