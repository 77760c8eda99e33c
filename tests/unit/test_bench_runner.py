"""pdserve bench's runner: a server that is not there fails requests, never the run."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.bench.client import Endpoint
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.runner import RunSettings, run_benchmark


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def test_unreachable_server_makes_every_request_fail_with_its_message():
    endpoint = Endpoint(f"http://127.0.0.1:{_closed_port()}/v1/completions", "m")
    requests = [SampleRequest("hello", 1, 4)] * 3
    run = asyncio.run(run_benchmark(RunSettings(endpoint, max_concurrency=2, progress=False), requests))
    assert [o.success for o in run.outputs] == [False, False, False]
    assert all(o.error.startswith("ConnectError:") for o in run.outputs)
    assert run.duration_s > 0 and run.cpu_s >= 0


def test_payload_is_portable_across_servers():
    endpoint = Endpoint("http://h/v1/chat/completions", "m", chat=True, ignore_eos=True, extra_body={"top_k": 1})
    assert endpoint.payload(SampleRequest("hi", 1, 7)) == {
        "model": "m", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "ignore_eos": True, "top_k": 1}
    plain = Endpoint("http://h/v1/completions", "m", temperature=None)
    assert plain.payload(SampleRequest("hi", 1, 7)) == {
        "model": "m", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}, "prompt": "hi"}


def test_zero_concurrency_is_refused():
    with pytest.raises(ValueError, match="max-concurrency"):
        RunSettings(Endpoint("http://h/v1/completions", "m"), max_concurrency=0)
