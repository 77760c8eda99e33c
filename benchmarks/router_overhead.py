"""Requests/s a router sustains and the latency it adds, with workers that answer at once:
pdserve (one process, --router-workers 2, and its calls to workers over gRPC instead of the
worker link) side by side with the Rust routers users pick instead (sglang-router,
vllm-router), same client, same prompts, same cores, one run.

    .venv/bin/python benchmarks/router_overhead.py [--concurrency 1,4,16] [--requests 300] [--requests-per-flight 100]
        [--routers pdserve,pdserve-x2,pdserve-grpc,sglang-router,vllm-router] ...

Method (printed with the results too):

- Workers: TEST DOUBLES that answer every call at once. pdserve's: benchmarks/instant_workers.py,
  one prefill and one decode serving real gRPC and the real worker link (proto/link), registered
  in a real (embedded) Redis with real heartbeats, read by the real `pdserve router` process
  (pdserve-grpc: `--worker-link false`, its calls over gRPC as before the link). The Rust routers': the HTTP twins in
  benchmarks/instant_http_workers.py (same tokens), each router in its prefill/decode mode
  (benchmarks/router_peers.py).
- Router path: pdserve bench's library (aiohttp, streamed /v1/completions, ignore_eos, the
  random dataset's prompts of --input-len tokens, --output-len tokens each) at each
  concurrency, all requests queued at once (closed loop: at most C in flight).
- Direct path, per kind of double: link / gRPC: the calls pdserve's router makes (already
  tokenized), straight from this process over the worker link / grpc.aio: Decode (read the
  ticket), Prefill, then the rest of the Decode stream. HTTP: a prefill POST (max_tokens 1), then the streamed decode POST,
  with aiohttp. Same concurrency and count.
- Latency: send to last token, per request; router-added = router path minus its direct path
  at the same percentile. HTTP floor: the decode POST alone, straight to the instant HTTP
  double, from the same client: the client's own cost of one streamed request, which
  pdserve's added latency includes (its direct path makes no HTTP request) and the Rust
  routers' does not (theirs makes two). req/s = requests / wall time of the run. The client runs on the
  same cores as the routers and the doubles, so its own CPU is part of every path; the table
  shows it, and the router's CPU (all its processes), so a saturated core is visible.
Every path gets --warmup requests first (not timed); the routers take turns per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks.common import REPO_ROOT, append_results, markdown_table, run_header, text_table  # noqa: E402
from benchmarks.peers.servers import exit_on_sigterm  # noqa: E402
from benchmarks.router_paths import PathRun, direct_path, merged, router_path  # noqa: E402
from benchmarks.router_peers import (  # noqa: E402
    RUST_ROUTERS,
    Started,
    direct_http_path,
    http_floor_path,
    process_cpu_s,
    start_rust_router,
    stop,
)
from pdserve.bench.client import Endpoint  # noqa: E402
from pdserve.bench.datasets import SampleRequest, random_requests  # noqa: E402
from pdserve.bench.main import first_model  # noqa: E402
from benchmarks.instant_http_workers import MODEL as HTTP_DOUBLE_MODEL  # noqa: E402
from pdserve.bench.runner import RunSettings, run_benchmark  # noqa: E402
from pdserve.redis_server import EmbeddedRedis, share_cluster_secrets  # noqa: E402

START_TIMEOUT_S = 60.0
CLUSTER = "router-overhead"
ROUTERS = ("pdserve", "pdserve-x2", "pdserve-grpc", *RUST_ROUTERS)
"""pdserve-x2: `pdserve router --router-workers 2`; pdserve-grpc: `--worker-link false`."""
OURS = ("pdserve", "pdserve-x2")
"""The routers the goals are about (pdserve-grpc is the link's baseline)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,16", help="in-flight requests, comma separated")
    p.add_argument("--requests", type=int, default=300, help="timed requests per path and concurrency")
    p.add_argument("--requests-per-flight", type=int, default=100,
                   help="at least this many timed requests per request in flight (16 in flight: 1600), the "
                        "prompts reused in turn, so a high concurrency is timed over more than a fraction of a second")
    p.add_argument("--warmup", type=int, default=30, help="untimed requests per path first")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=8, help="tokens per response")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every path this many times, routers taking turns; the table merges "
                        "the rounds and the goal lines give the spread of the per-round ratios")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma separated, of {', '.join(ROUTERS)}")
    p.add_argument("--router-source", default=None,
                   help="run pdserve's router from this checkout (a baseline commit: before/after)")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if min(args.concurrency + [args.requests, args.input_len, args.output_len, args.rounds]) < 1:
        p.error("--concurrency, --requests, --input-len, --output-len and --rounds must be positive")
    if args.requests_per_flight < 0:
        p.error("--requests-per-flight must be >= 0 (0: --requests at every concurrency)")
    if unknown := sorted(set(args.routers) - set(ROUTERS)):
        p.error(f"--routers: unknown {', '.join(unknown)}; known: {', '.join(ROUTERS)}")
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


def start_pdserve(name: str, redis_url: str, tmp: Path, source: str | None = None) -> Started:
    ready, log = tmp / f"{name}.ready", tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
           "--redis-url", redis_url, "--cluster", CLUSTER, "--ready-file", str(ready), "--log-level", "WARNING"]
    if name == "pdserve-x2":
        cmd += ["--router-workers", "2"]
    if name == "pdserve-grpc":
        cmd += ["--worker-link", "false"]
    root = Path(source).resolve() if source else REPO_ROOT
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(root)})
    try:
        http_port = int(_wait_for_file(ready, process, name).split()[0])
    except RuntimeError:
        stop(process)
        raise
    base = f"http://127.0.0.1:{http_port}"
    model = asyncio.run(first_model(base, {}))
    return Started(name, process, Endpoint(f"{base}/v1/completions", model, ignore_eos=True),
                   "grpc" if name == "pdserve-grpc" else "link", log)


# ------------------------------------------------------------------ the paths# -------------------------------------------------------------------- driving
@dataclass(frozen=True)
class Measured:
    router: str
    concurrency: int
    rounds: tuple[PathRun, ...]
    """The router path, once per round."""
    direct: PathRun
    """Its direct path, all rounds merged."""
    floor: PathRun | None = None
    """The client's own streamed HTTP request at this concurrency (http_floor_path), all rounds."""

    @property
    def run(self) -> PathRun:
        return merged(list(self.rounds))


@dataclass(frozen=True)
class Doubles:
    grpc: tuple[str, str]
    """(prefill, decode) gRPC addresses."""
    link: tuple[str, str]
    """(prefill, decode) worker link addresses."""
    http: tuple[str, str]
    """(prefill, decode) base URLs."""
    pids: tuple[int, int] = (0, 0)
    """(pdserve's doubles, the HTTP doubles) processes."""

    def cpu_s(self, direct: str) -> float:
        """CPU seconds so far of the doubles a router with this direct path calls."""
        return process_cpu_s(self.pids[1] if direct == "http" else self.pids[0])


async def measure_all(args, routers: list[Started], doubles: Doubles, tokenizer) -> list[Measured]:
    total = args.requests + args.warmup
    requests = random_requests(tokenizer, total, args.input_len, args.output_len, seed=args.seed)
    # pdserve's router tokenizes the text; the gRPC direct path gets the ids it would send.
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    warm, timed = requests[:args.warmup], requests[args.warmup:]
    results = []
    for c in args.concurrency:
        count = timed_count(args, c)
        timed_c = [timed[i % len(timed)] for i in range(count)]
        prompts_c = prompts[:args.warmup] + [prompts[args.warmup + i % len(timed)] for i in range(count)]
        direct: dict[str, list[PathRun]] = {"link": [], "grpc": [], "http": [], "floor": []}
        runs: dict[str, list[PathRun]] = {r.name: [] for r in routers}
        for k in range(args.rounds):
            await measure_round(args, routers, doubles, prompts_c, warm, timed_c, c, f"c{c}r{k}", direct, runs)
        floor = merged(direct["floor"]) if direct["floor"] else None
        for router in routers:
            results.append(Measured(router.name, c, tuple(runs[router.name]), merged(direct[router.direct]), floor))
    return results


def timed_count(args, concurrency: int) -> int:
    """Timed requests per path at `concurrency`: --requests, or --requests-per-flight for each
    request in flight when that is more (300 at 16 in flight were ~0.3 s of the fastest paths)."""
    return max(args.requests, args.requests_per_flight * concurrency)


async def measure_round(args, routers: list[Started], doubles: Doubles, prompts: list[list[int]],
                       warm: list[SampleRequest], timed: list[SampleRequest], c: int, tag: str,
                       direct: dict[str, list[PathRun]], runs: dict[str, list[PathRun]]) -> None:
    """Each direct path, then each router, once at concurrency c (appended to direct / runs)."""
    for kind, addresses in (("link", doubles.link), ("grpc", doubles.grpc)):
        if any(r.direct == kind for r in routers):
            link = kind == "link"
            if warm:
                await direct_path(addresses, prompts[:args.warmup], args.output_len, c, f"w{kind}{tag}", link)
            direct[kind].append(await direct_path(addresses, prompts[args.warmup:], args.output_len, c,
                                                  f"{kind}{tag}", link))
    if any(r.direct == "http" for r in routers):
        if warm:
            await direct_http_path(*doubles.http, HTTP_DOUBLE_MODEL, warm, c)
        latencies, failed, seconds, cpu = await direct_http_path(*doubles.http, HTTP_DOUBLE_MODEL, timed, c)
        direct["http"].append(PathRun(latencies, failed, seconds, cpu, 0.0))
    if any(r.direct == "link" for r in routers):  # what of pdserve's added latency is the client's own
        latencies, failed, seconds, cpu = await http_floor_path(doubles.http[1], HTTP_DOUBLE_MODEL, timed, c)
        direct["floor"].append(PathRun(latencies, failed, seconds, cpu, 0.0))
    for router in routers:
        if warm:
            await router_path(router, warm, c)
        run = await router_path(router, timed, c, lambda: doubles.cpu_s(router.direct))
        runs[router.name].append(run)
        print(f"  {router.name} at {c} in flight: {run.req_per_s:.1f} req/s, p50 {run.percentile_ms(50):.2f} ms "
              f"(direct {direct[router.direct][-1].percentile_ms(50):.2f} ms)", flush=True)


HEADERS = ["router", "concurrency", "req/s", "direct req/s", "p50 ms", "direct p50 ms", "added p50 ms",
           "p99 ms", "direct p99 ms", "added p99 ms", "router CPU %", "router CPU ms/req", "doubles CPU ms/req",
           "client CPU %", "failed"]


def table_rows(results: list[Measured]) -> list[list[str]]:
    rows = []
    for m in results:
        r, d = m.run, m.direct
        rows.append([
            m.router, m.concurrency, f"{r.req_per_s:.1f}", f"{d.req_per_s:.1f}",
            f"{r.percentile_ms(50):.2f}", f"{d.percentile_ms(50):.2f}",
            f"{r.percentile_ms(50) - d.percentile_ms(50):.2f}", f"{r.percentile_ms(99):.2f}",
            f"{d.percentile_ms(99):.2f}", f"{r.percentile_ms(99) - d.percentile_ms(99):.2f}",
            f"{100 * r.router_cpu_s / r.seconds:.0f}", f"{1e3 * r.router_cpu_s / max(1, len(r.latencies_s)):.2f}",
            f"{1e3 * r.doubles_cpu_s / max(1, len(r.latencies_s)):.2f}", f"{100 * r.client_cpu_s / r.seconds:.0f}",
            f"{r.failed}/{d.failed}",
        ])
    return rows


def goal_lines(results: list[Measured]) -> list[str]:
    """The issue's goals: req/s at the highest concurrency >= each Rust router's; added p50 at
    the lowest <= 1 ms."""
    top, low = max(m.concurrency for m in results), min(m.concurrency for m in results)
    at = {(m.router, m.concurrency): m for m in results}
    lines = []
    for ours in OURS:
        for peer in RUST_ROUTERS:
            if (ours, top) in at and (peer, top) in at:
                ratio = at[ours, top].run.req_per_s / at[peer, top].run.req_per_s
                lines.append(f"{ours} / {peer} req/s at {top} in flight: {ratio:.2f}x "
                             f"({'met' if ratio >= 1.0 else 'NOT MET'}; goal >= 1.0x)"
                             + round_spread(at[ours, top], at[peer, top]))
        if (ours, low) in at:
            m = at[ours, low]
            added = m.run.percentile_ms(50) - m.direct.percentile_ms(50)
            lines.append(f"{ours} added p50 at {low} in flight: {added:.2f} ms "
                         f"({'met' if added <= 1.0 else 'NOT MET'}; goal <= 1 ms)")
            if m.floor is not None:
                floor = m.floor.percentile_ms(50)
                lines.append(f"{ours} added p50 at {low} in flight beyond the client's own streamed HTTP request: "
                             f"{added - floor:.2f} ms (that request alone, straight to the instant HTTP double: "
                             f"{floor:.2f} ms; {ours}'s direct path makes none, the Rust routers' makes two)")
    spent = [f"{m.router} {cpu_per_request_ms(m.run):.2f}" for m in results if m.concurrency == top]
    if spent:
        lines.append(f"CPU per request at {top} in flight, router + doubles + client (what the shared cores "
                     f"spend per request, in ms): {', '.join(spent)}")
    if ("pdserve", top) in at and ("pdserve-grpc", top) in at:
        a, b = at["pdserve", top], at["pdserve-grpc", top]
        cpu = [1e3 * m.run.router_cpu_s / max(1, len(m.run.latencies_s)) for m in (a, b)]
        lines.append(f"pdserve (worker link) / pdserve-grpc req/s at {top} in flight: "
                     f"{a.run.req_per_s / b.run.req_per_s:.2f}x{round_spread(a, b)}; router CPU per request "
                     f"{cpu[0]:.2f} vs {cpu[1]:.2f} ms")
    return lines


def cpu_per_request_ms(run: PathRun) -> float:
    return 1e3 * (run.router_cpu_s + run.doubles_cpu_s + run.client_cpu_s) / max(1, len(run.latencies_s))


def round_spread(ours: Measured, peer: Measured) -> str:
    """", per round: 0.81-0.97x" (each round's req/s ratio, the same round of both), or "" for one round."""
    ratios = [a.req_per_s / b.req_per_s for a, b in zip(ours.rounds, peer.rounds, strict=True)]
    return "" if len(ratios) < 2 else f", per round: {min(ratios):.2f}-{max(ratios):.2f}x"


def method_lines(args, skipped: list[str]) -> list[str]:
    lines = [
        f"timed requests per path and concurrency: {', '.join(f'{timed_count(args, c)} at {c} in flight' for c in args.concurrency)} "
        f"({args.requests} prompts, reused in turn past that), after {args.warmup} untimed, "
        f"{args.rounds} round(s) (routers take turns in each; the table merges the rounds); prompts of "
        f"{args.input_len} tokens (random dataset, seed {args.seed}), {args.output_len} output tokens, ignore_eos.",
        "pdserve: the real `pdserve router` (pdserve-x2: --router-workers 2; pdserve-grpc: --worker-link false) "
        "in front of benchmarks/instant_workers.py doubles (1 prefill + 1 decode, serving gRPC and the worker "
        "link) registered in an embedded Redis; "
        "sglang-router / vllm-router: their prefill/decode modes in front of benchmarks/instant_http_workers.py "
        "HTTP doubles (same tokens, answered at once).",
        "router path: pdserve bench library (aiohttp, streamed /v1/completions). direct path for pdserve's doubles: "
        "the router's own calls (Decode -> ticket, Prefill, rest of the Decode stream) over the worker link "
        "(pdserve, pdserve-x2) or grpc.aio (pdserve-grpc); for the "
        "HTTP doubles: prefill POST (max_tokens 1) then the streamed decode POST with aiohttp. HTTP floor: the "
        "decode POST alone, to the HTTP double, same client.",
        "latency: send to last token; added = router path - its direct path at that percentile; "
        "req/s = requests / wall seconds; router CPU % = the router's processes' CPU over its run "
        "(100 = one core); router CPU ms/req = the same CPU per request served (the figure least moved by other "
        "load on the machine); doubles CPU ms/req = the CPU of the doubles process that router calls, per "
        "request (pdserve's: instant_workers.py; the Rust routers': instant_http_workers.py); client CPU % = "
        "this process over the same run; failed = router/direct.",
        f"usable cores: {len(os.sched_getaffinity(0))}; client, routers and doubles share them. "
        "Load average (1/5/15 min) at the end: " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + ".",
    ]
    if args.router_source:
        lines.append(f"pdserve's router ran from {args.router_source}.")
    return lines + [f"not measured: {why}" for why in skipped]


def report(results: list[Measured], args, skipped: list[str]) -> tuple[str, str]:
    rows, method, goals = table_rows(results), method_lines(args, skipped), goal_lines(results)
    terminal = "\n\n".join(["\n".join(run_header()), text_table(HEADERS, rows), "\n".join(goals), "\n".join(method)])
    markdown = "\n\n".join([markdown_table(HEADERS, rows), "\n".join(f"- {g}" for g in goals),
                            "Method:\n\n" + "\n".join(f"- {line}" for line in method)])
    return terminal, markdown


async def wait_until_routable(router: Started, tokenizer) -> None:
    """A router routes only once it sees the doubles (Redis snapshot; Rust routers' health checks)."""
    probe = random_requests(tokenizer, 1, 8, 2, seed=1)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"{router.name} exited with {router.process.returncode}; see {router.log}")
        run = await run_benchmark(RunSettings(router.endpoint, progress=False), probe)
        if run.outputs[0].success:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{router.name} never served a request: {run.outputs[0].error}")


def start_doubles(stack: contextlib.ExitStack, redis_url: str, tmp: Path) -> Doubles:
    script = REPO_ROOT / "benchmarks"
    grpc_ready, http_ready = tmp / "grpc-doubles", tmp / "http-doubles"
    grpc_doubles = subprocess.Popen([sys.executable, str(script / "instant_workers.py"), "--redis-url", redis_url,
                                     "--cluster", CLUSTER, "--ready-file", str(grpc_ready)], cwd=REPO_ROOT)
    stack.callback(stop, grpc_doubles)
    http_doubles = subprocess.Popen([sys.executable, str(script / "instant_http_workers.py"),
                                     "--ready-file", str(http_ready)], cwd=REPO_ROOT)
    stack.callback(stop, http_doubles)
    prefill, decode, prefill_link, decode_link = _wait_for_file(grpc_ready, grpc_doubles, "instant doubles").split()
    return Doubles((prefill, decode), (prefill_link, decode_link),
                   tuple(_wait_for_file(http_ready, http_doubles, "instant HTTP doubles").split()),
                   (grpc_doubles.pid, http_doubles.pid))


def start_routers(stack: contextlib.ExitStack, args, redis_url: str, doubles: Doubles, tmp: Path,
                  tokenizer) -> tuple[list[Started], list[str]]:
    routers, skipped = [], []
    for name in args.routers:
        if name in RUST_ROUTERS:
            started = start_rust_router(name, *doubles.http, HTTP_DOUBLE_MODEL, tmp)
        else:
            started = start_pdserve(name, redis_url, tmp, args.router_source)
        if isinstance(started, str):
            print(f"skipping {started}", flush=True)
            skipped.append(started)
            continue
        stack.callback(stop, started.process)
        asyncio.run(wait_until_routable(started, tokenizer))
        routers.append(started)
    return routers, skipped


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # SIGTERM unwinds, so the routers, doubles and Redis started below are stopped
    from engine.loader.locate import default_model_path
    from engine.tokenizer import load_tokenizer

    args = parse_args(argv)
    tokenizer = load_tokenizer(default_model_path())
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp, contextlib.ExitStack() as stack:
        redis = EmbeddedRedis().start()
        stack.callback(redis.stop)
        share_cluster_secrets(redis)
        doubles = start_doubles(stack, redis.url, Path(tmp))
        routers, skipped = start_routers(stack, args, redis.url, doubles, Path(tmp), tokenizer)
        print(f"measuring {', '.join(r.name for r in routers)} ...", flush=True)
        results = asyncio.run(measure_all(args, routers, doubles, tokenizer))
    terminal, markdown = report(results, args, skipped)
    print("\n" + terminal)
    if not args.no_results:
        print(f"\nappended to {append_results('router_overhead', markdown)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
