"""Requests/s the router sustains and the latency it adds, with workers that answer at once.

    .venv/bin/python benchmarks/router_overhead.py [--concurrency 1,4,16] [--requests 300] ...

Method (printed with the results too):

- Workers: benchmarks/instant_workers.py, TEST DOUBLES of one prefill and one decode worker
  that answer every call at once over real gRPC, registered in a real (embedded) Redis with
  real heartbeats. Router: the real `pdserve router` process, reading that Redis.
- Router path: pdserve bench's library (httpx, streamed /v1/completions, ignore_eos, the
  random dataset's prompts of --input-len tokens, --output-len tokens each) at each
  concurrency, all requests queued at once (closed loop: at most C in flight).
- Direct path: the same requests as the router would send them (already tokenized), made
  straight to the doubles from this process with grpc.aio: Decode (read the ticket), Prefill,
  then read the Decode stream to its end; same concurrency and count.
- Latency: send to last token, per request; router-added = router path minus direct path at
  the same percentile. req/s = requests / wall time of the run. The client runs on the same
  2 cores as the router and the doubles, so its own CPU is part of both paths; the table
  shows it, and the router process's CPU, so a saturated core is visible.
Both paths get --warmup requests first (not timed); paths alternate per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import REPO_ROOT, append_results, markdown_table, run_header, text_table  # noqa: E402
from pdserve.bench.client import Endpoint  # noqa: E402
from pdserve.bench.datasets import SampleRequest, random_requests  # noqa: E402
from pdserve.bench.main import first_model  # noqa: E402
from pdserve.bench.runner import RunSettings, run_benchmark  # noqa: E402
from pdserve.redis_server import EmbeddedRedis, share_cluster_secrets  # noqa: E402
from proto.auth import load_cluster_secret  # noqa: E402
from proto.internal_auth import internal_channel  # noqa: E402
from proto.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402

START_TIMEOUT_S = 60.0
CLUSTER = "router-overhead"


@dataclass(frozen=True)
class PathRun:
    """One path at one concurrency."""

    latencies_s: list[float]
    failed: int
    seconds: float
    client_cpu_s: float
    router_cpu_s: float

    @property
    def req_per_s(self) -> float:
        return len(self.latencies_s) / self.seconds

    def percentile_ms(self, p: float) -> float:
        return float(np.percentile(self.latencies_s, p)) * 1e3 if self.latencies_s else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,16", help="in-flight requests, comma separated")
    p.add_argument("--requests", type=int, default=300, help="timed requests per path and concurrency")
    p.add_argument("--warmup", type=int, default=30, help="untimed requests per path first")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=8, help="tokens per response")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if min(args.concurrency + [args.requests, args.input_len, args.output_len]) < 1:
        p.error("--concurrency, --requests, --input-len and --output-len must be positive")
    return args


# ------------------------------------------------------------------ processes
def _wait_for_file(path: Path, process: subprocess.Popen, what: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} while starting")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S:g} s")


def _stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the paths
async def router_path(endpoint: Endpoint, requests: list[SampleRequest], concurrency: int,
                      router_pid: int) -> PathRun:
    settings = RunSettings(endpoint, max_concurrency=concurrency, progress=False)
    cpu0 = process_cpu_s(router_pid)
    run = await run_benchmark(settings, requests)
    ok = [o.latency for o in run.outputs if o.success]
    return PathRun(ok, len(run.outputs) - len(ok), run.duration_s, run.cpu_s, process_cpu_s(router_pid) - cpu0)


async def direct_call(prefill, decode, request_id: str, prompt_ids: list[int], max_tokens: int) -> float:
    """The router's calls for one request, made straight to the doubles; returns seconds."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    stream = decode.Decode(worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                                    sampling=sampling, ticket_timeout_ms=60_000))
    first = await stream.read()
    await prefill.Prefill(worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                                    sampling=sampling, ticket=first.ticket))
    while (event := await stream.read()) is not grpc.aio.EOF:
        if event.tokens.finish_reason:
            break
    return time.perf_counter() - start


async def direct_path(addresses: tuple[str, str], prompts: list[list[int]], max_tokens: int, concurrency: int,
                      router_pid: int, tag: str) -> PathRun:
    secret = load_cluster_secret()  # what the router proves too: the comparison stays fair
    async with internal_channel(addresses[0], secret) as p_chan, internal_channel(addresses[1], secret) as d_chan:
        prefill, decode = worker_pb2_grpc.PrefillWorkerStub(p_chan), worker_pb2_grpc.DecodeWorkerStub(d_chan)
        queue = list(enumerate(prompts))
        latencies: list[float] = []
        failed = 0

        async def worker() -> None:
            nonlocal failed
            while queue:
                i, ids = queue.pop(0)
                try:
                    latencies.append(await direct_call(prefill, decode, f"{tag}-{i}", ids, max_tokens))
                except grpc.aio.AioRpcError:
                    failed += 1

        cpu0, router0, start = time.process_time(), process_cpu_s(router_pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        return PathRun(latencies, failed, seconds, time.process_time() - cpu0, process_cpu_s(router_pid) - router0)


# -------------------------------------------------------------------- driving
@dataclass(frozen=True)
class Measured:
    concurrency: int
    router: PathRun
    direct: PathRun


async def measure_all(args, endpoint: Endpoint, addresses: tuple[str, str], tokenizer, router_pid: int):
    total = args.requests + args.warmup
    requests = random_requests(tokenizer, total, args.input_len, args.output_len, seed=args.seed)
    # The router tokenizes the text; the direct path gets the ids it would send.
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    warm, timed = requests[:args.warmup], requests[args.warmup:]
    results = []
    for c in args.concurrency:
        if warm:
            await router_path(endpoint, warm, c, router_pid)
            await direct_path(addresses, prompts[:args.warmup], args.output_len, c, router_pid, f"w{c}")
        router = await router_path(endpoint, timed, c, router_pid)
        direct = await direct_path(addresses, prompts[args.warmup:], args.output_len, c, router_pid, f"c{c}")
        results.append(Measured(c, router, direct))
        print(f"  concurrency {c}: router {router.req_per_s:.1f} req/s (p50 {router.percentile_ms(50):.2f} ms), "
              f"direct {direct.req_per_s:.1f} req/s (p50 {direct.percentile_ms(50):.2f} ms)", flush=True)
    return results


HEADERS = ["concurrency", "router req/s", "direct req/s", "ratio (router/direct)", "router p50 ms",
           "direct p50 ms", "router-added p50 ms", "router p99 ms", "direct p99 ms", "router-added p99 ms",
           "router CPU %", "client CPU %", "failed"]


def table_rows(results: list[Measured]) -> list[list[str]]:
    rows = []
    for m in results:
        r, d = m.router, m.direct
        rows.append([
            m.concurrency, f"{r.req_per_s:.1f}", f"{d.req_per_s:.1f}", f"{r.req_per_s / d.req_per_s:.2f}x",
            f"{r.percentile_ms(50):.2f}", f"{d.percentile_ms(50):.2f}",
            f"{r.percentile_ms(50) - d.percentile_ms(50):.2f}", f"{r.percentile_ms(99):.2f}",
            f"{d.percentile_ms(99):.2f}", f"{r.percentile_ms(99) - d.percentile_ms(99):.2f}",
            f"{100 * r.router_cpu_s / r.seconds:.0f}", f"{100 * r.client_cpu_s / r.seconds:.0f}",
            f"{r.failed}/{d.failed}",
        ])
    return rows


def method_lines(args) -> list[str]:
    return [
        f"{args.requests} timed requests per path and concurrency after {args.warmup} untimed; prompts of "
        f"{args.input_len} tokens (random dataset, seed {args.seed}), {args.output_len} output tokens, ignore_eos.",
        "workers: benchmarks/instant_workers.py test doubles (1 prefill + 1 decode) that answer at once over real "
        "gRPC, registered in an embedded Redis with heartbeats; router: the real `pdserve router` process.",
        "router path: pdserve bench library (httpx, streamed /v1/completions); direct path: the router's own gRPC "
        "calls (Decode -> ticket, Prefill, rest of the Decode stream) from this process with grpc.aio.",
        "latency: send to last token; router-added = router path - direct path at that percentile; "
        "req/s = requests / wall seconds; router CPU % = the router process's CPU over the router run "
        "(100 = one core); client CPU % = this process over the same run; failed = router/direct.",
        f"usable cores: {len(os.sched_getaffinity(0))}; client, router and doubles share them. "
        "Load average (1/5/15 min) at the end: " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + ".",
    ]


def report(results: list[Measured], args) -> tuple[str, str]:
    rows, method = table_rows(results), method_lines(args)
    best = max(results, key=lambda m: m.router.req_per_s)
    summary = (f"router sustains up to {best.router.req_per_s:.0f} req/s (concurrency {best.concurrency}); "
               f"it adds {statistics.median([m.router.percentile_ms(50) - m.direct.percentile_ms(50) for m in results]):.2f} ms "
               "at p50 (median over concurrencies).")
    terminal = "\n\n".join(["\n".join(run_header()), text_table(HEADERS, rows), summary, "\n".join(method)])
    markdown = "\n\n".join([markdown_table(HEADERS, rows), f"- {summary}",
                            "Method:\n\n" + "\n".join(f"- {line}" for line in method)])
    return terminal, markdown


def start_router(redis_url: str, ready: Path, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
           "--redis-url", redis_url, "--cluster", CLUSTER, "--ready-file", str(ready), "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


async def wait_until_routable(endpoint: Endpoint, tokenizer) -> None:
    """The router routes only once its Redis snapshot lists the doubles."""
    probe = random_requests(tokenizer, 1, 8, 2, seed=1)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        run = await run_benchmark(RunSettings(endpoint, progress=False), probe)
        if run.outputs[0].success:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the router never served a request: {run.outputs[0].error}")


def main(argv: list[str] | None = None) -> int:
    from engine.loader.locate import default_model_path
    from engine.tokenizer import load_tokenizer

    args = parse_args(argv)
    tokenizer = load_tokenizer(default_model_path())
    redis, workers, router = EmbeddedRedis().start(), None, None
    share_cluster_secrets(redis)
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        try:
            workers_ready, router_ready = Path(tmp) / "workers", Path(tmp) / "router"
            workers = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "benchmarks" / "instant_workers.py"), "--redis-url", redis.url,
                 "--cluster", CLUSTER, "--ready-file", str(workers_ready)], cwd=REPO_ROOT)
            addresses = tuple(_wait_for_file(workers_ready, workers, "instant workers").split())
            with open(Path(tmp) / "router.log", "w") as log:
                router = start_router(redis.url, router_ready, log)
                http_port = int(_wait_for_file(router_ready, router, "pdserve router").split()[0])
                base = f"http://127.0.0.1:{http_port}"
                model = asyncio.run(first_model(base, {}))
                endpoint = Endpoint(f"{base}/v1/completions", model, ignore_eos=True)
                asyncio.run(wait_until_routable(endpoint, tokenizer))
                print(f"router {base} -> instant doubles {addresses}; measuring ...", flush=True)
                results = asyncio.run(measure_all(args, endpoint, addresses, tokenizer, router.pid))
        finally:
            _stop(router)
            _stop(workers)
            redis.stop()
    terminal, markdown = report(results, args)
    print("\n" + terminal)
    if not args.no_results:
        print(f"\nappended to {append_results('router_overhead', markdown)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
