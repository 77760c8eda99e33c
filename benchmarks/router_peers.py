"""The routers benchmarks/router_overhead.py compares, and how each is started and measured.

- pdserve: `pdserve router` (one process, or `--router-workers N`) in front of the instant gRPC
  doubles (benchmarks/instant_workers.py), reading them from Redis.
- sglang-router and vllm-router (PyPI; `pip install 'pdserve[bench-peers]'`): the Rust routers
  users pick instead, each in its prefill/decode mode (`--pd-disaggregation`,
  `--vllm-pd-disaggregation`), in front of the instant HTTP doubles
  (benchmarks/instant_http_workers.py) that answer with the same tokens at once.

Each router has a direct path to its doubles, measured the same way, so "router-added" is the
router's own cost: the gRPC direct path is the router's calls made straight from the client
process (router_overhead.direct_path); the HTTP direct path is a prefill POST (max_tokens 1, not
streamed) then the streamed decode POST — what vllm-router does; sglang-router sends both at
once, so its direct path is the slower of the two orders.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from pdserve.bench.client import Endpoint, open_session, send_request
from pdserve.bench.datasets import SampleRequest
from pdserve.ports import free_port

START_TIMEOUT_S = 60.0
RUST_ROUTERS = ("sglang-router", "vllm-router")


@dataclass
class Started:
    """A router process to measure (and to stop)."""

    name: str
    process: subprocess.Popen
    endpoint: Endpoint
    direct: str
    """Which direct path it is measured against: "link" or "grpc" (pdserve's doubles) or "http"."""
    log: Path = field(default=Path())

    def cpu_s(self) -> float:
        """CPU seconds of the router process and every process under it (the N of
        --router-workers; sglang's launcher and its Rust server)."""
        return sum(process_cpu_s(pid) for pid in process_tree(self.process.pid))


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux /proc); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def rust_router_command(name: str) -> Path | None:
    """The console script of a Rust router installed beside this Python, or None."""
    found = Path(sys.executable).parent / name
    if found.exists():
        return found
    which = shutil.which(name)
    return Path(which) if which else None


def rust_router_argv(name: str, command: Path, prefill_url: str, decode_url: str, port: int) -> list[str]:
    """Each in its prefill/decode mode, defaults otherwise; its Prometheus exporter on a free port
    (both default to 29000)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port())]
    if name == "sglang-router":
        return [str(command), "launch", "--pd-disaggregation", "--prefill", prefill_url, "none",
                "--decode", decode_url, *common, "--log-level", "warn"]
    if name == "vllm-router":
        return [str(command), "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
                *common, "--log-level", "warning"]
    raise ValueError(f"unknown Rust router {name!r}; known: {', '.join(RUST_ROUTERS)}")


def start_rust_router(name: str, prefill_url: str, decode_url: str, model: str, log_dir: Path) -> Started | str:
    """The router started (not yet known to route), or why it was not (one line)."""
    command = rust_router_command(name)
    if command is None:
        return f"{name}: not installed (pip install 'pdserve[bench-peers]')"
    port, log = free_port(), log_dir / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(rust_router_argv(name, command, prefill_url, decode_url, port),
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1/completions", model, ignore_eos=True)
    return Started(name, process, endpoint, "http", log)


def stop(process: subprocess.Popen | None) -> None:
    """SIGINT, then SIGKILL after 15 s."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


async def direct_http_call(client: aiohttp.ClientSession, prefill_url: str | None, decode: Endpoint,
                           request: SampleRequest) -> float | None:
    """Prefill (one token, not streamed; none when prefill_url is None), then the streamed
    decode; seconds, None on failure."""
    start = time.perf_counter()
    if prefill_url is not None:
        body = {**decode.payload(request), "stream": False, "max_tokens": 1}
        body.pop("stream_options", None)
        async with client.post(f"{prefill_url}/v1/completions", data=orjson.dumps(body),
                               headers={"Content-Type": "application/json"}) as response:
            await response.read()
            if response.status != 200:
                return None
    output = await send_request(client, decode, request)
    if not output.success:
        return None
    return time.perf_counter() - start


async def http_floor_path(decode_url: str, model: str, requests: list[SampleRequest],
                          concurrency: int) -> tuple[list[float], int, float, float]:
    """The client's own cost of one streamed request: the decode POST alone, straight to the
    instant HTTP double (what no front door can go below); as direct_http_path returns."""
    return await direct_http_path(None, decode_url, model, requests, concurrency)


async def direct_http_path(prefill_url: str | None, decode_url: str, model: str, requests: list[SampleRequest],
                           concurrency: int) -> tuple[list[float], int, float, float]:
    """(latencies, failed, wall seconds, client CPU seconds) of the HTTP direct path (prefill_url
    None: the decode POST alone)."""
    decode = Endpoint(f"{decode_url}/v1/completions", model, ignore_eos=True)
    queue, latencies, failed = list(requests), [], 0
    async with open_session(2 * concurrency, timeout_s=60) as client:
        async def worker() -> None:
            nonlocal failed
            while queue:
                seconds = await direct_http_call(client, prefill_url, decode, queue.pop(0))
                if seconds is None:
                    failed += 1
                else:
                    latencies.append(seconds)

        cpu0, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, failed, time.perf_counter() - start, time.process_time() - cpu0
