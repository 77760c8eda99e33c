"""Scaling a role under load: goodput and inter-token latency before, during and after a
scale-up (1+1 -> 2+2) and a scale-down (2+2 -> 1+1), side by side in one run.

    .venv/bin/python benchmarks/scale_under_load.py [--rate 0.5] [--window 40] [--output-len 64] ...

Method (printed with the results too):

- Cluster: `pdserve up --prefill 1 --decode 1` (the default model, a small KV cache) started the
  way tests/e2e does it (tests/e2e/cluster.py), on free 127.0.0.1 ports, so the admin routes
  are open to this (local) caller without a key.
- Load: open loop for the whole run: streamed /v1/completions sent at the times of a gamma
  process (pdserve.bench.arrivals, vLLM's: --rate requests/s, --burstiness 1 = Poisson), each
  a different prompt of --input-words random words and --output-len tokens (ignore_eos,
  greedy), timed chunk by chunk by pdserve.bench's client. A request is never retried.
- Timeline: --warmup s, then `before` (--window s at 1+1); `PUT /v1/roles/{prefill,decode}`
  {"replicas": 2}; `scale-up` lasts until GET /v1/roles shows ready == desired for both roles
  and nothing draining; `after up` (--window s at 2+2); the same with {"replicas": 1}:
  `scale-down` (until the removed workers drained and exited), `after down`.
- Per window: requests sent in it, completed requests/s and output tokens/s (requests whose
  last token, and tokens that arrived, inside the window, over its length), ITL p50/p99 (the gaps
  that end inside the window), TTFT p50/p99 and failures of the requests sent in it.
  Every process shares the machine's cores, so more workers add no compute on a small host:
  the table shows what scaling costs and whether it loses requests, not a speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import append_results, markdown_table, text_table  # noqa: E402
from pdserve.bench.arrivals import arrival_offsets  # noqa: E402
from pdserve.bench.client import Endpoint, RequestOutput, open_session, send_request  # noqa: E402
from pdserve.bench.datasets import SampleRequest  # noqa: E402
from pdserve.bench.metrics import token_times  # noqa: E402
from tests.e2e.cluster import start_cluster  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers scale a "
         "cluster under load and count every block twice before the drain ends").split()
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Window:
    name: str
    shape: str
    """prefill+decode workers serving in it ("1+1 -> 2+2" while scaling)."""
    start: float
    end: float
    """perf_counter seconds."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=0.5,
                   help="requests per second (open loop); 0.5 is under what 1+1 serves on 2 shared cores")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--input-words", type=int, default=100, help="words per prompt (~1.2 tokens each)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (ignore_eos)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first window")
    p.add_argument("--window", type=float, default=40.0, help="seconds of each steady window")
    p.add_argument("--settle-timeout", type=float, default=180.0,
                   help="longest a scale-up or scale-down may take before the run gives up")
    p.add_argument("--kv-cache-memory", default="256MiB", help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the windows and per-request results here (JSON)")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    p.add_argument("--up-flag", action="append", default=[], help="extra flag for pdserve up (repeatable)")
    return p.parse_args(argv)


# ------------------------------------------------------------------ load
def sample_request(rng: random.Random, words: int, output_len: int) -> SampleRequest:
    """A prompt no other request shares (a random word order), so prefix caching does not help."""
    return SampleRequest(" ".join(rng.choice(WORDS) for _ in range(words)), words, output_len)


async def open_loop(endpoint: Endpoint, args: argparse.Namespace, stop: asyncio.Event) -> list[RequestOutput]:
    """Send at the arrival times until `stop`, then wait (bounded) for what is in flight."""
    horizon_s = 3600.0  # arrivals are drawn for an hour; `stop` ends the run long before
    offsets = arrival_offsets(math.ceil(args.rate * horizon_s), args.rate, args.burstiness, args.seed)
    rng = random.Random(args.seed)
    async with open_session(timeout_s=300.0) as client:
        tasks: list[asyncio.Task] = []
        origin = time.perf_counter()
        for offset in offsets:
            wait_s = origin + offset - time.perf_counter()
            if wait_s > 0:
                try:
                    await asyncio.wait_for(stop.wait(), wait_s)
                except asyncio.TimeoutError:
                    pass
            if stop.is_set():
                break
            request = sample_request(rng, args.input_words, args.output_len)
            tasks.append(asyncio.create_task(send_request(client, endpoint, request)))
        done, pending = await asyncio.wait(tasks, timeout=300) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        return [t.result() for t in tasks if t in done]


# ------------------------------------------------------------------ scaling
async def roles(control: httpx.AsyncClient) -> dict[str, dict]:
    r = await control.get("/v1/roles")
    r.raise_for_status()
    return {entry["role"]: entry for entry in r.json()["roles"]}


async def scale_and_settle(control: httpx.AsyncClient, replicas: int, timeout_s: float) -> None:
    """PUT both roles to `replicas`, then until each is ready == desired with none draining."""
    for role in ROLES:
        r = await control.put(f"/v1/roles/{role}", json={"replicas": replicas})
        if r.status_code not in (200, 202):
            raise RuntimeError(f"PUT /v1/roles/{role} answered {r.status_code}: {r.text}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = await roles(control)
        if all(now[role]["desired"] == now[role]["ready"] == replicas and now[role]["draining"] == 0
               for role in ROLES):
            return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"the cluster did not reach {replicas}+{replicas} in {timeout_s:.0f} s: {now}")


async def timeline(base_url: str, args: argparse.Namespace, stop: asyncio.Event) -> list[Window]:
    """The windows of the run; sets `stop` at the end (or on failure)."""
    windows: list[Window] = []
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as control:
            await asyncio.sleep(args.warmup)
            for name, shape, replicas in (("before", "1+1", None), ("scale-up", "1+1 -> 2+2", 2),
                                          ("after up", "2+2", None), ("scale-down", "2+2 -> 1+1", 1),
                                          ("after down", "1+1", None)):
                start = time.perf_counter()
                if replicas is None:
                    await asyncio.sleep(args.window)
                else:
                    await scale_and_settle(control, replicas, args.settle_timeout)
                windows.append(Window(name, shape, start, time.perf_counter()))
    except (RuntimeError, httpx.HTTPError) as exc:  # report the windows measured so far
        print(f"scaling failed, the run ends here: {exc}", file=sys.stderr)
    finally:
        stop.set()
    return windows


async def run(base_url: str, args: argparse.Namespace) -> tuple[list[Window], list[RequestOutput]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    endpoint = Endpoint(f"{base_url}/v1/completions", model, ignore_eos=True, temperature=0.0)
    stop = asyncio.Event()
    load = asyncio.create_task(open_loop(endpoint, args, stop))
    windows = await timeline(base_url, args, stop)
    return windows, await load


# ------------------------------------------------------------------ report
def percentile_ms(values_s: list[float], p: float) -> str:
    return f"{np.percentile(np.asarray(values_s) * 1000, p):.0f}" if values_s else "-"


def window_row(w: Window, outputs: list[RequestOutput]) -> list[object]:
    inside = lambda t: w.start <= t < w.end  # noqa: E731
    length = w.end - w.start
    sent = [o for o in outputs if inside(o.start_time)]
    ok = [o for o in outputs if o.success]
    finished = [o for o in ok if inside(o.start_time + o.latency)]
    tokens = sum(inside(t) for o in ok for t in token_times(o))
    gaps = [gap for o in ok for gap, t in zip(o.itl, token_times(o)[1:]) if inside(t)]
    ttfts = [o.ttft for o in sent if o.success]
    return [w.name, w.shape, f"{length:.1f}", len(sent), f"{len(finished) / length:.2f}", f"{tokens / length:.1f}",
            percentile_ms(gaps, 50), percentile_ms(gaps, 99), percentile_ms(ttfts, 50), percentile_ms(ttfts, 99),
            sum(not o.success for o in sent)]


HEADERS = ["window", "workers (P+D)", "seconds", "sent", "completed req/s", "output tok/s",
           "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms", "failed"]


def method(args: argparse.Namespace) -> str:
    return (f"Method: `pdserve up --prefill 1 --decode 1` (default model, --kv-cache-memory {args.kv_cache_memory}) "
            f"on 127.0.0.1; open-loop streamed /v1/completions at {args.rate:g} req/s (gamma gaps, burstiness "
            f"{args.burstiness:g}), {args.input_words}-word random prompts, {args.output_len} output tokens "
            f"(ignore_eos, greedy). {args.warmup:g} s warm-up, then {args.window:g} s windows before and after "
            "each scale; a scale window lasts from the PUTs to GET /v1/roles showing ready == desired and none "
            "draining. Completed req/s and tok/s count requests finished and tokens arriving inside a window; "
            "ITL gaps ending inside it; TTFT and failures of requests sent inside it. All processes share "
            "this machine's cores.")


def report(args: argparse.Namespace, windows: list[Window], outputs: list[RequestOutput]) -> str:
    rows = [window_row(w, outputs) for w in windows]
    failed = [o.error for o in outputs if not o.success]
    summary = (f"- requests: {len(outputs)} sent, {len(outputs) - len(failed)} ok, {len(failed)} failed"
               + (f" (first errors: {sorted(set(failed))[:3]})" if failed else ""))
    print(text_table(HEADERS, rows), "\n")
    print(summary)
    return "\n\n".join([markdown_table(HEADERS, rows), summary, method(args)])


def write_out(path: Path, windows: list[Window], outputs: list[RequestOutput]) -> None:
    path.write_text(json.dumps({"windows": [asdict(w) for w in windows],
                                "requests": [asdict(o) for o in outputs]}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `timeout` / kill send SIGTERM: unwind through the finally below so the cluster is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="pdserve-scale-") as tmp:
        cluster = start_cluster(Path(tmp), "--prefill", "1", "--decode", "1", "--max-model-len", "1024",
                                "--kv-cache-memory", args.kv_cache_memory, *args.up_flag)
        try:
            windows, outputs = asyncio.run(run(cluster.base_url, args))
        finally:
            cluster.stop()
    body = report(args, windows, outputs)
    if args.out:
        write_out(args.out, windows, outputs)
    if not args.no_results:
        print("appended to", append_results("scale under load (1+1 -> 2+2 -> 1+1)", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
