"""Token delivery delay under concurrent streams: the worker link against gRPC between the router
and its workers, alternated in one run.

    .venv/bin/python benchmarks/token_delivery.py [--rounds 2] [--settings link,grpc]

Method (printed with the results too):

- Each round starts `pdserve up --prefill 1 --decode 1 --kv-cache-memory 512MiB` (the default
  model, free 127.0.0.1 ports) once per setting, one after the other, never two at once:
  `link` is the default router, `grpc` adds `--worker-link false` (the router's Decode,
  Prefill and Abort over gRPC, as before the link), `int8` is `link` with the workers' int4
  linears on int8 activations (`--dtype bfloat16 --int4-activations int8`: on a CPU without
  AVX512-BF16 the bfloat16 dtype is what keeps the Q4 blocks, which `--dtype auto` loads dense
  in float32; where it has AVX512-BF16 this is the default's path), `bf16act` is `link` with
  bfloat16 activations (`--int4-activations bfloat16`, the default before 2026-12-07). The
  settings alternate first place.
- Load: a warm-up run of the same shape (other prompts: a cold cluster's first run is slower),
  then pdserve bench's library on /v1/completions:
  --num-prompts random prompts of --input-len tokens, --output-len tokens each (ignore_eos,
  greedy), at most --concurrency in flight, all queued at once.
- Delivery delay of a token: its arrival at the client (time.time()) minus the time the decode
  or prefill worker sampled it (the SSE chunk's pdserve_sampled_at; same host, same clock),
  pooled over every token; first tokens (a request's first chunk) and later tokens also apart.
- ITL: gaps between a request's streamed chunks (pdserve bench's definition); tokens per chunk:
  output tokens / chunks (above 1 when the router sent tokens that reached it together in one).
- The cluster runs in this process's session (its own process group, for stopping it), so the
  client shares one scheduling group with the cluster. Linux with autogroup scheduling
  (/proc/sys/kernel/sched_autogroup_enabled = 1, the default on desktop and many VM kernels)
  shares CPU between sessions first and applies nice only inside one, so with the cluster in a
  session of its own, the engine's lowered priority (EngineConfig.engine_nice) ranks it below
  the router but not below this client: on 2 shared cores the client's event loop then stalled
  for 20-145 ms at a time, holding tokens the router had written in time (up to 73 ms), and
  those stalls decided the p99. A real client is not on the server's cores at all. The
  `own-session` setting is `link` with the cluster in a session of its own, as before, to
  show the difference; every setting reports the client's own loop stalls (a 1 ms sleeper's
  lateness over 20 ms), the part of the delay that is this machine's, not the path's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import append_results, markdown_table, run_header, text_table  # noqa: E402
from benchmarks.peers.servers import exit_on_sigterm, session_kwargs  # noqa: E402
from pdserve.bench.client import Endpoint  # noqa: E402
from pdserve.bench.datasets import random_requests  # noqa: E402
from pdserve.bench.main import TOKEN_TIMES  # noqa: E402
from pdserve.bench.metrics import compute_metrics  # noqa: E402
from pdserve.bench.runner import RunSettings, run_benchmark  # noqa: E402
from pdserve.ports import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 300.0
SETTINGS = {"link": [], "grpc": ["--worker-link", "false"], "int8": ["--dtype", "bfloat16", "--int4-activations", "int8"],
            "bf16act": ["--int4-activations", "bfloat16"], "own-session": []}
OWN_SESSION = {"own-session"}
"""Settings whose cluster runs in a session of its own (see the module's docstring)."""
STALL_S = 0.020
"""A pause of the client's event loop longer than this counts as a stall."""
GOAL_P99_MS = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternated")
    p.add_argument("--settings", default="link,grpc", help=f"comma separated, of {', '.join(SETTINGS)}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=420)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-model-len", type=int, default=None, help="passed on to pdserve up (default: the model's)")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if unknown := sorted(set(args.settings) - set(SETTINGS)):
        p.error(f"--settings: unknown {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    if min(args.rounds, args.num_prompts, args.input_len, args.output_len, args.concurrency) < 1:
        p.error("--rounds, --num-prompts, --input-len, --output-len and --concurrency must be positive")
    return args


def start_cluster(setting: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    port, grpc_port = free_ports(2)
    cmd = [sys.executable, "-m", "pdserve", "up", "--prefill", "1", "--decode", "1", "--kv-cache-memory",
           args.kv_cache_memory, "--port", str(port), "--grpc-port", str(grpc_port), *SETTINGS[setting]]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, **session_kwargs(setting in OWN_SESSION))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up ({setting}) exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"pdserve up ({setting}) not ready within {START_TIMEOUT_S:.0f} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


async def measure(base: str, args, tokenizer) -> dict[str, float]:
    endpoint = Endpoint(f"{base}/v1/completions", MODEL, ignore_eos=True, temperature=0.0, headers=TOKEN_TIMES)
    warm = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, seed=1000)
    await run_benchmark(RunSettings(endpoint, max_concurrency=args.concurrency, progress=False), warm)
    requests = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, seed=0)
    stalls: list[float] = []
    watch = asyncio.create_task(watch_loop(stalls))
    try:
        run = await run_benchmark(RunSettings(endpoint, max_concurrency=args.concurrency, progress=False), requests)
    finally:
        watch.cancel()
    m = compute_metrics(run.outputs, run.duration_s)
    ok = [o for o in run.outputs if o.success]
    first = [o.delivery[0] for o in ok if o.delivery]
    later = [d for o in ok for d in o.delivery[1:]]
    ms = lambda xs, p: 1e3 * float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
    return {"p99": m.delivery.percentiles[-1][1] if m.delivery else float("nan"),
            "mean": m.delivery.mean if m.delivery else float("nan"),
            "first_p50": ms(first, 50), "first_p99": ms(first, 99), "later_p50": ms(later, 50),
            "later_p99": ms(later, 99), "itl_mean": m.stats["itl"].mean, "itl_p99": m.stats["itl"].percentiles[-1][1],
            "tokens_per_chunk": sum(o.output_tokens for o in ok) / max(1, sum(len(o.itl) + 1 for o in ok)),
            "stalls": float(len(stalls)), "stall_max": 1e3 * max(stalls, default=0.0),
            "failed": float(m.failed)}


async def watch_loop(stalls: list[float]) -> None:
    """Until cancelled: sleep 1 ms at a time on this event loop and record each lateness over
    STALL_S (seconds the loop could not run: its own work, or no core for this process)."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        late = time.perf_counter() - start - 0.001
        if late > STALL_S:
            stalls.append(late)


HEADERS = ["round", "setting", "delivery p99 ms", "delivery mean ms", "first tokens p50 / p99 ms",
           "later tokens p50 / p99 ms", "ITL mean / p99 ms", f"client stalls > {STALL_S * 1e3:.0f} ms: count / max ms",
           "tokens per chunk", "failed"]


def autogroup() -> str:
    try:
        return {"1": "on", "0": "off"}.get(Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip(), "?")
    except OSError:
        return "not present"


def goal_line(setting: str, p99s: list[float]) -> str:
    """The goal's verdict for one setting over its runs: "met in every run", "NOT MET in any
    run", or "met in k of n runs"."""
    met = sum(p <= GOAL_P99_MS for p in p99s)
    verdict = ("met in every run" if met == len(p99s) else "NOT MET in any run" if met == 0
               else f"met in {met} of {len(p99s)} runs")
    return (f"{setting}: token delivery p99 {min(p99s):.2f}-{max(p99s):.2f} ms over {len(p99s)} run(s) "
            f"({verdict}: goal <= {GOAL_P99_MS:g} ms)")


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # SIGTERM unwinds, so the cluster of the round is stopped
    from engine.loader.locate import default_model_path
    from engine.tokenizer import load_tokenizer

    args = parse_args(argv)
    tokenizer = load_tokenizer(default_model_path())
    rows, by_setting = [], {s: [] for s in args.settings}
    with tempfile.TemporaryDirectory(prefix="token-delivery-") as tmp:
        for k in range(args.rounds):
            order = args.settings if k % 2 == 0 else list(reversed(args.settings))
            for setting in order:
                process, base = start_cluster(setting, args, Path(tmp) / f"{setting}-{k}.log")
                try:
                    r = asyncio.run(measure(base, args, tokenizer))
                finally:
                    stop(process)
                by_setting[setting].append(r)
                rows.append([k + 1, setting, f"{r['p99']:.2f}", f"{r['mean']:.2f}",
                             f"{r['first_p50']:.1f} / {r['first_p99']:.1f}", f"{r['later_p50']:.2f} / {r['later_p99']:.2f}",
                             f"{r['itl_mean']:.1f} / {r['itl_p99']:.1f}", f"{int(r['stalls'])} / {r['stall_max']:.0f}",
                             f"{r['tokens_per_chunk']:.2f}",
                             int(r["failed"])])
                print(f"  round {k + 1} {setting}: delivery p99 {r['p99']:.2f} ms, ITL mean {r['itl_mean']:.1f} ms",
                      flush=True)
    goals = [goal_line(s, [x["p99"] for x in v]) for s, v in by_setting.items() if v]
    method = [f"pdserve up --prefill 1 --decode 1 --kv-cache-memory {args.kv_cache_memory}, per setting in turn "
              f"(link: the default; grpc: --worker-link false; int8: --dtype bfloat16 --int4-activations int8; bf16act: "
              f"--int4-activations bfloat16; own-session: link in a "
              f"session of its own), {args.rounds} round(s), first place alternating",
              "session: the cluster in the client's session (its own process group), except own-session; kernel "
              f"autogroup scheduling: {autogroup()}",
              f"load: a warm-up run of the same shape (other prompts), then {args.num_prompts} random prompts of {args.input_len} tokens, "
              f"{args.output_len} tokens each, ignore_eos, greedy, at most {args.concurrency} in flight",
              "delivery delay: a token's arrival at the client minus its sample time on the worker (same host clock), "
              "pooled over tokens; first tokens = each request's first chunk; ITL = gaps between streamed chunks",
              f"client stalls: the bench client's event loop late by more than {STALL_S * 1e3:.0f} ms (a 1 ms sleeper "
              "beside the streams, timed run only)"]
    terminal = "\n\n".join(["\n".join(run_header()), text_table(HEADERS, rows), "\n".join(goals), "\n".join(method)])
    print("\n" + terminal)
    if not args.no_results:
        markdown = "\n\n".join([markdown_table(HEADERS, rows), "\n".join(f"- {g}" for g in goals),
                                "Method:\n\n" + "\n".join(f"- {line}" for line in method)])
        print(f"\nappended to {append_results('token delivery under concurrent streams (link vs gRPC)', markdown)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
