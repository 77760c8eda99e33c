"""The router app served by uvicorn on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from tests.unit.router_doubles import MODEL, make_app, token_steps

KEY = "sk-service-test"
PARIS = [7042, 314, 9239, 30, 378, 1112]  # " Paris", " is", " nice", ".", " The", " end"
IM_END = 2


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Serve `app` in a background thread on a free port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_openai_client_completes_and_streams_chat():
    steps = token_steps([*PARIS[:4], IM_END], "stop", stop_token_id=IM_END)
    app, backend = make_app(steps, api_key=KEY)
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]

        completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
        assert completion.choices[0].text == " Paris is nice."
        assert completion.choices[0].finish_reason == "stop"
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (1, 5)

        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    assert deltas == ["", " Paris", " is", " nice", ".", ""]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (31, 5)
    assert [r.request_id[-2:] for r in backend.requests] == ["-0", "-0"]


def test_openai_client_sees_vllms_errors():
    app, _ = make_app(token_steps(PARIS), api_key=KEY)
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError) as not_found:
            client.completions.create(model="gpt-4", prompt="Hello")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert not_found.value.body == {
        "message": "The model `gpt-4` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_openai_client_sending_tools_gets_vllms_bad_request_without_a_parser():
    app, backend = make_app(token_steps(PARIS), api_key=KEY)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[tool])
        with pytest.raises(openai.BadRequestError) as empty:
            client.chat.completions.create(model=MODEL, messages=[])
    assert refused.value.body["message"].startswith(
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    assert (refused.value.body["param"], empty.value.body["param"]) == ("tool_choice", "messages")
    assert backend.requests == []


def test_closing_a_stream_over_tcp_aborts_the_backend_request():
    app, backend = make_app(token_steps(PARIS), hold_after=2)
    body = {"prompt": "Hello", "max_tokens": 6, "stream": True}
    with serve(app) as url, httpx.Client(base_url=url) as client:
        headers = {"x-request-id": "tcp-1"}
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.headers["x-pdserve-path"] == "disaggregated"
            lines = response.iter_lines()
            assert next(lines).startswith('data: {"id":"cmpl-tcp-1"')
            wait_for(backend.holding.is_set)
        # Leaving the block closed the connection while the backend was between tokens.
        wait_for(lambda: backend.aborted == ["b1-0"])
