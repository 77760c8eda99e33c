"""A client that goes away makes the router abort the backend requests it started.

These drive the ASGI app directly, so the test decides exactly when the client disconnects.
"""

from __future__ import annotations

import asyncio
import json

from router.api.openai_models import CompletionRequest
from tests.unit.router_doubles import ScriptedBackend, make_app, make_service, token_steps

PARIS = [7042, 314, 9239, 30, 378, 1112]


def scope(path: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"req-1")],
        "client": ("127.0.0.1", 50000),
        "server": ("router", 80),
    }


def serve_until_gone(app, path: str, body: dict, gone: asyncio.Event | None = None,
                     gone_after_chunks: int | None = None) -> list[dict]:  # fmt: skip
    """Run one request; the client disconnects when `gone` is set or after N body chunks."""

    async def go() -> list[dict]:
        left_event = gone or asyncio.Event()
        sent: list[dict] = []
        pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await left_event.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
            if gone_after_chunks is not None and len(chunks) >= gone_after_chunks:
                left_event.set()

        await asyncio.wait_for(app(scope(path), receive, send), timeout=5)
        return sent

    return asyncio.run(go())


def test_client_disconnect_mid_stream_aborts_the_backend_request():
    app, backend = make_app(token_steps(PARIS), hold_after=2)
    body = {"prompt": "Hello", "max_tokens": 6, "stream": True}
    sent = serve_until_gone(app, "/v1/completions", body, gone_after_chunks=2)
    texts = [json.loads(m["body"][6:])["choices"][0]["text"] for m in sent[1:]]
    assert texts == [" Paris", " is"]
    assert sent[-1]["more_body"] is True  # the stream was cut, never finished
    assert backend.aborted == ["b1-0"]
    assert backend.closed == ["b1-0"]


def test_client_disconnect_mid_chat_stream_aborts_every_choice():
    app, backend = make_app(token_steps(PARIS), hold_after=1)
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True}
    serve_until_gone(app, "/v1/chat/completions", body, gone_after_chunks=4)
    assert backend.aborted == ["b1-0", "b1-1"]


def test_client_disconnect_while_waiting_for_a_whole_completion_aborts_the_backend():
    app, backend = make_app(token_steps(PARIS), hold_after=1)
    sent = serve_until_gone(app, "/v1/completions", {"prompt": "Hello"}, gone=backend.holding)
    assert sent[0]["status"] == 499
    assert backend.aborted == ["b1-0"]


def test_client_disconnect_before_the_first_token_of_a_stream_aborts_the_backend():
    app, backend = make_app(token_steps(PARIS), hold_after=0)
    body = {"prompt": "Hello", "stream": True}
    sent = serve_until_gone(app, "/v1/completions", body, gone=backend.holding)
    assert sent[0]["status"] == 499
    assert backend.aborted == ["b1-0"]


def test_a_started_stream_closed_without_being_read_aborts_the_backend():
    backend = ScriptedBackend(token_steps(PARIS))
    service = make_service(backend)

    async def go():
        stream = await service.stream_complete(CompletionRequest(prompt="Hello", stream=True), "r")
        await stream.aclose()

    asyncio.run(go())
    assert backend.aborted == ["b1-0"]


def test_until_disconnect_runs_the_work_in_the_callers_task_and_turns_a_departure_into_client_disconnected():
    from router.api.event_stream import ClientDisconnected, until_disconnect

    async def go() -> None:
        left = asyncio.Event()
        seen: list[object] = []

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def work(result: str) -> str:
            seen.append(asyncio.current_task())
            return result

        caller = asyncio.current_task()
        assert await until_disconnect(receive, work("done")) == "done"
        assert seen == [caller]  # no task of its own: the result is on hand in the same pass

        async def forever() -> None:
            try:
                left.set()
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        try:
            await until_disconnect(receive, forever())
        except ClientDisconnected:
            seen.append("disconnected")
        assert seen[1:] == ["cancelled", "disconnected"]
        assert caller.cancelling() == 0  # the watcher's cancel is not left on the task

        # a cancel from elsewhere (the server stopping) stays a cancel
        left.clear()
        task = asyncio.ensure_future(until_disconnect(receive, asyncio.sleep(60)))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert task.cancelled()

    asyncio.run(asyncio.wait_for(go(), timeout=5))


def test_until_disconnect_with_a_broken_receive_still_finishes_the_work():
    """A receive() that raises (a broken connection) ends only the watcher: the work is not
    cancelled and its result comes back."""
    from router.api.event_stream import until_disconnect

    async def go() -> str:
        async def receive() -> dict:
            raise OSError("connection reset")

        async def work() -> str:
            await asyncio.sleep(0.01)
            return "done"

        return await until_disconnect(receive, work())

    assert asyncio.run(asyncio.wait_for(go(), timeout=5)) == "done"


def test_one_disconnect_watch_serves_the_handler_and_the_response():
    """A request's DisconnectWatch keeps one watcher (one pending receive) across both of its
    waits; a client that leaves between them is found at the second, whose work never starts;
    close() ends the watcher."""
    from router.api.event_stream import ClientDisconnected, DisconnectWatch

    async def go() -> None:
        left = asyncio.Event()
        receives = 0

        async def receive() -> dict:
            nonlocal receives
            receives += 1
            await left.wait()
            return {"type": "http.disconnect"}

        async def work(result: str) -> str:
            await asyncio.sleep(0)
            return result

        watch = DisconnectWatch(receive)
        assert await watch.until(work("first")) == "first"
        assert await watch.until(work("second")) == "second"
        assert receives == 1  # one watcher for both

        left.set()  # the client leaves while nothing is awaited
        for _ in range(3):
            await asyncio.sleep(0)
        assert watch.left
        started = []

        async def never() -> None:
            started.append(True)

        try:
            await watch.until(never())
        except ClientDisconnected:
            started.append("disconnected")
        assert started == ["disconnected"]  # its work was closed, not run
        assert asyncio.current_task().cancelling() == 0
        watch.close()

        # close() while the watcher waits: it ends, and cancels nobody
        left.clear()
        watch = DisconnectWatch(receive)
        assert await watch.until(work("x")) == "x"
        watcher = watch._watcher
        watch.close()
        await asyncio.sleep(0)
        assert watcher.cancelled()

    asyncio.run(asyncio.wait_for(go(), timeout=5))
