"""--autoscale under a prefill-heavy load: TTFT p99 before and after the cluster reached the
planner's recommendation, and the recommendation with its arithmetic.

    .venv/bin/python benchmarks/autoscale.py [--rate 1.0] [--input-words 300] [--slo-ttft-ms 2000] ...
    .venv/bin/python benchmarks/autoscale.py --tiny --no-results      # a quick smoke run

Method (printed with the results too):

- Cluster: `pdserve up --prefill 1 --decode 1 --autoscale` (the default model, a small KV
  cache) started the way tests/e2e does it, with the SLO, the planner's window and the
  autoscaler's interval, cooldown and max per role given here.
- Load: open loop for the whole run (scale_under_load's: gamma arrivals at --rate, each a
  different prompt of --input-words random words and --output-len tokens, ignore_eos, greedy):
  long prompts and short outputs, so one prefill worker is overwhelmed and decode is not.
- Timeline: --warmup s, then `before` lasts until the autoscaler changes a desired count
  (GET /v1/roles); `scaling` until ready == desired for both roles and nothing draining;
  `after` is --window s at the shape reached. GET /v1/plan is recorded when the count changed
  and at the end.
- Per window: scale_under_load's columns (TTFT p99 of the requests sent inside the window).
  Every process shares this machine's cores: a second prefill worker adds compute only where
  a core is free. The load average is recorded with the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import httpx  # noqa: E402

from benchmarks.common import append_results, markdown_table, text_table  # noqa: E402
from benchmarks.scale_under_load import HEADERS, Window, open_loop, percentile_ms, window_row  # noqa: E402
from pdserve.bench.client import Endpoint, RequestOutput  # noqa: E402
from tests.e2e.cluster import start_cluster  # noqa: E402

ROLES = ("prefill", "decode")
TINY = {"rate": 0.5, "input_words": 120, "output_len": 2, "warmup": 3.0, "window": 10.0, "plan_window": 10.0,
        "change_timeout": 60.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (open loop)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--input-words", type=int, default=300, help="words per prompt (~1.2 tokens each)")
    p.add_argument("--output-len", type=int, default=4, help="max_tokens per request (ignore_eos)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="the router's --slo-ttft-ms")
    p.add_argument("--plan-window", type=float, default=20.0, help="the router's --plan-window (seconds)")
    p.add_argument("--autoscale-interval", type=float, default=2.0, help="the router's --autoscale-interval")
    p.add_argument("--autoscale-cooldown", type=float, default=20.0, help="the router's --autoscale-cooldown")
    p.add_argument("--max-per-role", type=int, default=2, help="--autoscale-max-prefill/decode and --max-replicas")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the first window")
    p.add_argument("--window", type=float, default=40.0, help="seconds measured after the cluster settled")
    p.add_argument("--change-timeout", type=float, default=180.0,
                   help="longest wait for the autoscaler's first change before the run gives up")
    p.add_argument("--settle-timeout", type=float, default=180.0, help="longest wait for the new workers")
    p.add_argument("--kv-cache-memory", default="256MiB", help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a short smoke run (low rate, short windows)")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
    return args


def up_flags(args: argparse.Namespace) -> list[str]:
    n = str(args.max_per_role)
    return ["--prefill", "1", "--decode", "1", "--max-model-len", "2048", "--kv-cache-memory", args.kv_cache_memory,
            "--max-replicas", n, "--autoscale", "--autoscale-max-prefill", n, "--autoscale-max-decode", n,
            "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--plan-window", f"{args.plan_window:g}",
            "--autoscale-interval", f"{args.autoscale_interval:g}",
            "--autoscale-cooldown", f"{args.autoscale_cooldown:g}", "--prefill-timeout", "300",
            "--stream-idle-timeout", "300"]


async def poll_roles(control: httpx.AsyncClient, until, timeout_s: float) -> dict[str, dict]:
    """GET /v1/roles every 0.25 s until until(roles) (bounded: RuntimeError past timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await control.get("/v1/roles")
        r.raise_for_status()
        now = {entry["role"]: entry for entry in r.json()["roles"]}
        if until(now):
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"not reached in {timeout_s:.0f} s: {now}")
        await asyncio.sleep(0.25)


def changed(roles: dict[str, dict]) -> bool:
    return any(roles[r]["desired"] != 1 for r in ROLES)


def settled(roles: dict[str, dict]) -> bool:
    return all(roles[r]["desired"] == roles[r]["ready"] and roles[r]["draining"] == 0 for r in ROLES)


def shape(roles: dict[str, dict]) -> str:
    return "+".join(str(roles[r]["desired"]) for r in ROLES)


async def timeline(base_url: str, args: argparse.Namespace, stop: asyncio.Event) -> tuple[list[Window], list[dict]]:
    """The windows of the run and the plans recorded; sets `stop` at the end (or on failure)."""
    windows: list[Window] = []
    plans: list[dict] = []
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as control:
            await asyncio.sleep(args.warmup)
            start = time.perf_counter()
            try:
                now = await poll_roles(control, changed, args.change_timeout)
            finally:  # the plan and the TTFT at 1+1 are reported even when the autoscaler never acted
                plans.append((await control.get("/v1/plan")).json())
                windows.append(Window("before", "1+1", start, time.perf_counter()))
            start, target = time.perf_counter(), shape(now)
            now = await poll_roles(control, settled, args.settle_timeout)
            windows.append(Window("scaling", f"1+1 -> {target}", start, time.perf_counter()))
            start = time.perf_counter()
            await asyncio.sleep(args.window)
            windows.append(Window("after", shape(now), start, time.perf_counter()))
            plans.append((await control.get("/v1/plan")).json())
    except (RuntimeError, httpx.HTTPError) as exc:  # report what was measured so far
        print(f"the run ends early: {exc}", file=sys.stderr)
    finally:
        stop.set()
    return windows, plans


async def run(base_url: str, args: argparse.Namespace) -> tuple[list[Window], list[dict], list[RequestOutput]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    endpoint = Endpoint(f"{base_url}/v1/completions", model, ignore_eos=True, temperature=0.0)
    stop = asyncio.Event()
    load = asyncio.create_task(open_loop(endpoint, args, stop))
    windows, plans = await timeline(base_url, args, stop)
    return windows, plans, await load


def plan_lines(label: str, body: dict) -> list[str]:
    rec, cur = body["recommended"], body["current"]
    return [f"- plan {label}: current {cur['prefill']}+{cur['decode']}, recommended {rec['prefill']}+{rec['decode']} "
            f"(prefill: {body['reasons']['prefill']}; decode: {body['reasons']['decode']})",
            *[f"    - {line}" for line in body["arithmetic"]]]


def verdict(args: argparse.Namespace, windows: list[Window], outputs: list[RequestOutput]) -> str:
    """TTFT p99 before vs after, against the SLO."""
    def p99(name: str) -> str:
        w = next((w for w in windows if w.name == name), None)
        ttfts = [] if w is None else [o.ttft for o in outputs if o.success and w.start <= o.start_time < w.end]
        return percentile_ms(ttfts, 99)

    before, after = p99("before"), p99("after")
    met = after != "-" and float(after) <= args.slo_ttft_ms
    return (f"- TTFT p99: before {before} ms, after {after} ms (SLO {args.slo_ttft_ms:g} ms: "
            f"{'met' if met else 'not met'} after)")


def method(args: argparse.Namespace) -> str:
    return (f"Method: `pdserve up {' '.join(up_flags(args))}` (default model) on 127.0.0.1; open-loop streamed "
            f"/v1/completions at {args.rate:g} req/s (gamma gaps, burstiness {args.burstiness:g}), "
            f"{args.input_words}-word random prompts, {args.output_len} output tokens (ignore_eos, greedy). "
            f"{args.warmup:g} s warm-up; `before` lasts until the autoscaler changes a desired count, `scaling` "
            f"until the new workers are ready, `after` {args.window:g} s. TTFT of requests sent inside each window. "
            "All processes share this machine's cores.")


def report(args: argparse.Namespace, windows: list[Window], plans: list[dict], outputs: list[RequestOutput],
           load: tuple[float, float]) -> str:
    rows = [window_row(w, outputs) for w in windows]
    failed = [o.error for o in outputs if not o.success]
    lines = [verdict(args, windows, outputs),
             f"- requests: {len(outputs)} sent, {len(outputs) - len(failed)} ok, {len(failed)} failed",
             f"- load average (1 min) at start {load[0]:.2f}, at end {load[1]:.2f}"]
    labels = ("when the autoscaler acted", "at the end") if len(windows) > 1 else ("when the run gave up",)
    for label, body in zip(labels, plans):
        lines += plan_lines(label, body)
    print(text_table(HEADERS, rows), "\n")
    print("\n".join(lines))
    return "\n\n".join([markdown_table(HEADERS, rows), "\n".join(lines), method(args)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind so the cluster is stopped
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pdserve-autoscale-") as tmp:
        cluster = start_cluster(Path(tmp), *up_flags(args))
        try:
            windows, plans, outputs = asyncio.run(run(cluster.base_url, args))
        finally:
            cluster.stop()
    body = report(args, windows, plans, outputs, (load_start, os.getloadavg()[0]))
    if not args.no_results:
        print("appended to", append_results("autoscale under prefill-heavy load (1+1 -> planner's shape)", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
