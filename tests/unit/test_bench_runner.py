"""pdserve bench's runner: a server that is not there fails requests, never the run."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.bench.client import RESENDS, Endpoint
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
    assert all(o.error.startswith("ClientConnectorError:") for o in run.outputs)
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


SSE_BODY = (b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
            b'data: {"choices":[{"index":0,"text":"!","finish_reason":"length"}]}\n\n'
            b"data: [DONE]\n\n")


async def _serve(plan: list[str]):
    """A raw HTTP/1.1 server on 127.0.0.1 that treats its n-th connection as plan[n]:
    "drop" reads the request and closes without a byte; "answer" streams SSE_BODY; "cut"
    sends the status line and closes mid-stream. Returns (server, port, connections seen)."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        what = plan[min(len(seen), len(plan) - 1)]
        seen.append(what)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        if what == "answer":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(SSE_BODY), SSE_BODY))
        elif what == "cut":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 9999\r\n\r\n"
                         + SSE_BODY[:40])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _run_against(plan: list[str]):
    async def go():
        server, port, seen = await _serve(plan)
        async with server:
            endpoint = Endpoint(f"http://127.0.0.1:{port}/v1/completions", "m")
            run = await run_benchmark(RunSettings(endpoint, max_concurrency=1, progress=False),
                                      [SampleRequest("hello", 1, 2)])
        return run.outputs[0], seen

    return asyncio.run(go())


def test_a_request_the_server_dropped_unanswered_is_sent_again_and_counted():
    output, seen = _run_against(["drop", "answer"])
    assert output.success, output.error
    assert output.resent == 1 and seen == ["drop", "answer"]
    assert output.generated_text == "hi!" and output.output_tokens == 2


def test_a_server_that_never_answers_fails_after_the_resends():
    output, seen = _run_against(["drop"])
    assert not output.success
    assert output.error.startswith("ServerDisconnectedError:")
    assert output.resent == RESENDS and len(seen) == RESENDS + 1


def test_a_response_broken_after_it_started_is_not_sent_again():
    output, seen = _run_against(["cut", "answer"])
    assert not output.success and output.resent == 0 and seen == ["cut"]
