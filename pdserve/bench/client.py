"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Requests are portable across vLLM, pdserve and llama.cpp's llama-server: `max_tokens`,
`stream: true`, `stream_options.include_usage`, `ignore_eos` when asked, `temperature`.
Output tokens come from the final usage when the server sends it, else from the token chunks;
TTFT and ITL come from the arrival times of token chunks (see pdserve.bench.sse). A pdserve
router asked for them (X-Pdserve-Token-Times) also says when each token was sampled: the
difference to its arrival here is its delivery delay (both unix clocks: on one host exact, across
hosts as good as their clock sync).
A request never raises: HTTP errors, in-band errors and broken streams become a failed
`RequestOutput` carrying the message, but for one case: a request whose connection broke before
any byte of a response came back is sent again (at most RESENDS times; `resent` counts them).
A server that closes an idle keep-alive connection just as the client reuses it (llama-server
does: "Server disconnected") has not answered the request; counting it as failed would leave
that server fewer requests in flight than its peer in the same run.

The HTTP client is aiohttp (as vLLM's benchmark client), with its C HTTP parser: a streamed
request of 32 tokens cost this client 0.6-0.7 ms of CPU with it against 3.4-4.2 ms with httpx,
whose pure-Python parser took ~0.1 ms an SSE event. The client shares the host's cores with the
servers it measures, and the last of 16 streams' tokens of one decode step waited behind the
other 15's parsing: what the client spent was timed as the servers' latency.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.sse import SSEDecoder, parse_chunk


@dataclass(frozen=True)
class Endpoint:
    """Where and how every request of a run is sent."""

    api_url: str
    """Full URL, e.g. http://127.0.0.1:8000/v1/completions."""
    model: str
    """The `model` field of each request."""
    chat: bool = False
    """/v1/chat/completions (the prompt becomes one user message) instead of /v1/completions."""
    ignore_eos: bool = False
    temperature: float | None = 0.0
    """None leaves it to the server."""
    extra_body: Mapping[str, object] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def payload(self, request: SampleRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": request.expected_output_len, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


@dataclass(frozen=True)
class RequestOutput:
    """How one request went. Times are seconds; start_time is time.perf_counter()."""

    success: bool
    error: str = ""
    prompt_len: int = 0
    """The server's usage.prompt_tokens when it sent one, else the dataset's count."""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: tuple[float, ...] = ()
    """Gaps between consecutive token chunks."""
    latency: float = 0.0
    """Send to last token."""
    start_time: float = 0.0
    generated_text: str = ""
    delivery: tuple[float, ...] = ()
    """Per token whose sample time the server sent: arrival (time.time()) minus sample time."""
    resent: int = 0
    """Times the request was sent again after its connection broke before any response."""


RESENDS = 2
"""Most times one request is sent again after its connection broke before any response."""

CONNECT_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 6 * 3600.0
"""A long generation must not time out; waiting for a pooled connection has no bound of its own
(the run's concurrency limit decides how many wait)."""
KEEPALIVE_S = 1.0
"""Idle connections are dropped well before servers close them (llama-server and uvicorn close
after 5 s): reusing one the server is closing fails the request, a client artefact."""

_UNANSWERED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""Connection errors that, raised before the response's status line, mean the server never
answered (not ClientConnectorError, an OSError too: a server that is not there fails at once)."""


def open_session(max_connections: int | None = None, timeout_s: float = RUN_TIMEOUT_S) -> aiohttp.ClientSession:
    """The pooled HTTP session a run's requests share: at most `max_connections` open at once
    (None: no limit), idle ones kept KEEPALIVE_S. Use it as an async context manager."""
    connector = aiohttp.TCPConnector(limit=max_connections or 0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


class _Stream:
    """Accumulates one response's chunks (mutable; lives inside send_request only)."""

    def __init__(self, start: float, prompt_len: int) -> None:
        self.start, self.last = start, start
        self.prompt_len = prompt_len
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.text: list[str] = []
        self.tokens = 0
        self.usage_tokens: int | None = None
        self.finished = False
        self.error: str | None = None
        self.delivery: list[float] = []

    def add(self, payload: str, now: float, wall: float | None = None) -> None:
        """`now`: perf_counter at arrival; `wall`: time.time() at arrival (for delivery delay)."""
        chunk = parse_chunk(payload)
        if chunk.error is not None:
            self.error = chunk.error
            return
        wall = time.time() if wall is None else wall
        self.delivery += [wall - sampled for sampled in chunk.sampled_at]
        self.finished = self.finished or chunk.done or chunk.finish_reason is not None
        if chunk.prompt_tokens is not None:
            self.prompt_len = chunk.prompt_tokens
        if chunk.completion_tokens is not None:
            self.usage_tokens = chunk.completion_tokens
        if chunk.token:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.tokens += 1
            self.text.append(chunk.text)

    def output(self, resent: int = 0) -> RequestOutput:
        error = self.error
        if error is None and self.ttft is None:
            error = "the stream ended without a token"
        if error is None and not self.finished:
            error = "the stream ended before the response finished"
        return RequestOutput(
            success=error is None, error=error or "", prompt_len=self.prompt_len,
            output_tokens=self.usage_tokens if self.usage_tokens is not None else self.tokens,
            ttft=self.ttft or 0.0, itl=tuple(self.itl), latency=self.last - self.start,
            start_time=self.start, generated_text="".join(self.text), delivery=tuple(self.delivery),
            resent=resent,
        )


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, request: SampleRequest) -> RequestOutput:
    """POST one streamed request and time it (from the first send, resends included). Never
    raises (but lets cancellation through)."""
    start = time.perf_counter()
    body = orjson.dumps(endpoint.payload(request))
    headers = {"Content-Type": "application/json", **endpoint.headers}
    for resent in range(RESENDS + 1):
        stream, answered = _Stream(start, request.prompt_len), False
        try:
            # A resend goes on a connection of its own: the pool's other idle connections may
            # have been closed by the server too (llama-server closes several at once), and
            # aiohttp hands out one whose close it has not read yet.
            fresh = open_session(1, timeout_s=session.timeout.total or RUN_TIMEOUT_S) if resent else None
            async with fresh or contextlib.nullcontext(session) as client, \
                    client.post(endpoint.api_url, data=body, headers=headers) as response:
                answered = True
                if response.status != 200:
                    text = (await response.read()).decode("utf-8", "replace")
                    return RequestOutput(False, f"HTTP {response.status}: {text[:300]}",
                                         request.prompt_len, start_time=start, resent=resent)
                decoder = SSEDecoder()
                async for data in response.content.iter_any():
                    now, wall = time.perf_counter(), time.time()
                    for payload in decoder.feed(data):
                        stream.add(payload, now, wall)
                for payload in decoder.close():
                    stream.add(payload, time.perf_counter())
        except aiohttp.ClientConnectorError as exc:  # nothing listens there: no resend
            return _failed(exc, request, start, resent)
        except _UNANSWERED as exc:
            if answered or resent == RESENDS:
                return _failed(exc, request, start, resent)
            continue
        except Exception as exc:  # noqa: BLE001 — one broken request must not end the run
            return _failed(exc, request, start, resent)
        return stream.output(resent)
    raise AssertionError("unreachable: the last attempt returns")


def _failed(exc: Exception, request: SampleRequest, start: float, resent: int) -> RequestOutput:
    return RequestOutput(False, f"{type(exc).__name__}: {exc}", request.prompt_len, start_time=start, resent=resent)
