"""Disaggregated (1 prefill + 1 decode worker, one core each) vs colocated (one worker, both
cores) on this machine, under steady short chats with and without bursts of long prompts.

    .venv/bin/python benchmarks/disagg_vs_colocated.py [--quick] [--dtype auto|bfloat16|float32]
                        [--quantization auto|none|gguf|int8|int4] [--int4-activations auto|bfloat16|int8]
                        [--repeat 3] [--setups disaggregated,colocated,...]
                        [--slo-ttft-ms 1000] [--slo-tpot-ms 100] [--no-results]

Method (printed with the results too):

- Setups, one at a time, each with its own embedded Redis (pdserve.redis_server) and a
  `pdserve router` (not pinned: it may use both cores, as may the bench clients):
  disaggregated = `taskset -c A pdserve prefill --num-threads 1` + `taskset -c B pdserve decode
  --num-threads 1`; colocated = `taskset -c A,B pdserve decode --num-threads 2` alone, so the
  router sends every request to it and it prefills and decodes (pdserve up --colocated's path).
  disaggregated+decode-alone is disaggregated with the router, Redis and the bench clients on
  core A beside the prefill worker, so the decode worker has core B to itself, as it would on a
  real cluster. It tests one guess: that under bursts core A is busy, so unpinned processes
  wake on core B and take it from the decode engine (whose nice ranks it below them). The
  alternated runs in RESULTS.md did not confirm it (1.19x with this setup, 1.05x without).
- Phases per setup, after an untimed warm-up: "steady" = one `pdserve bench` process sending
  short chats at a fixed Poisson rate; "bursts" = the same stream (other prompts: another
  seed) with a second `pdserve bench` process sending ~2k-token prompts in gamma bursts
  (burstiness < 1) over the same period. Both setups get the same prompts and send times.
  Each setup runs both phases --repeat times (other seeds each round, the same in every setup),
  so one noisy run cannot decide: tables give the median and the spread (min / median / max),
  and the ITL ratio is taken per round (bursts_i / steady_i).
- Reported for the short-chat stream: decode ITL p99 (gaps between streamed tokens), TTFT
  p99, and goodput = requests/s that met the SLO (TTFT <= --slo-ttft-ms and TPOT <=
  --slo-tpot-ms, vLLM's --goodput) over the phase; for the bursts: their TTFT p99.
- Goals: with bursts, disaggregated ITL p99 <= 1.2x its steady value; goodput with bursts
  disaggregated >= 1.5x colocated.
- Every process runs in this script's session (a process group each), as `pdserve up`'s
  children do, so the engines' lowered priority ranks them below the router and the bench
  clients also where the kernel schedules by autogroup (shares CPU between sessions first).
  --own-sessions starts each in a session of its own, as the earlier runs in RESULTS.md did.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks.burst_gaps import BIG_BATCH, CLASSES, MIN_GAPS, batch_summary, gap_classes  # noqa: E402
from benchmarks.common import append_results, markdown_table, text_table  # noqa: E402
from benchmarks.peers.servers import (  # noqa: E402
    HOST, Processes, Server, exit_on_sigterm, finish_bench, free_port, http_ok, pdserve_command, pinned_cores,
    run_bench, start_bench, wait_until)

ITL_GOAL = 1.2
"""Most disaggregated ITL p99 with bursts / without."""
GOODPUT_GOAL = 1.5
"""Least goodput with bursts, disaggregated / colocated."""
MAX_MODEL_LEN = 4096
BURST_DELAY_S = 2.0
"""The burst stream starts this long after the short stream (its prompts are built meanwhile)."""
BENCH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Load:
    """The two streams: short chats at a steady rate, long prompts in bursts."""

    short_in: int
    short_out: int
    short_rate: float
    short_count: int
    long_in: int
    long_out: int
    long_rate: float
    long_count: int
    burstiness: float

    def describe(self) -> list[str]:
        return [
            f"- short chats: {self.short_count} random prompts of {self.short_in} tokens, {self.short_out} new "
            f"tokens, Poisson at {self.short_rate:g} req/s (~{self.short_count / self.short_rate:.0f} s)",
            f"- bursts: {self.long_count} random prompts of {self.long_in} tokens, {self.long_out} new tokens, "
            f"gamma arrivals (burstiness {self.burstiness:g}) at {self.long_rate:g} req/s on average, "
            f"starting {BURST_DELAY_S:g} s after the short chats",
        ]


FULL = Load(short_in=128, short_out=64, short_rate=1.0, short_count=60,
            long_in=2048, long_out=16, long_rate=0.15, long_count=8, burstiness=0.3)
QUICK = Load(short_in=64, short_out=16, short_rate=2.0, short_count=8,
             long_in=1024, long_out=4, long_rate=1.0, long_count=2, burstiness=0.5)


@dataclass(frozen=True)
class Layout:
    """Workers of one setup: (role, taskset cores, torch threads) each."""

    name: str
    workers: tuple[tuple[str, str, int], ...]
    router_flags: tuple[str, ...] = ()
    others: frozenset[int] | None = None
    """Cores of everything else this setup starts (router, Redis, bench clients); None: unpinned."""


LOCAL_PREFILL = ("--local-prefill-max-tokens", "256", "--local-prefill-min-queue", "1024")
"""The conditional-disaggregation variant: prompts of <= 256 tokens are prefilled on the decode
worker while the prefill worker has >= 1024 tokens queued."""


def layouts() -> list[Layout]:
    a, b = pinned_cores(2)
    disaggregated = (("prefill", str(a), 1), ("decode", str(b), 1))
    return [Layout("disaggregated", disaggregated),
            Layout("disaggregated+decode-alone", disaggregated, others=frozenset({a})),
            Layout("disaggregated+local", disaggregated, LOCAL_PREFILL),
            Layout("colocated", (("decode", f"{a},{b}", 2),))]


def start_setup(procs: Processes, layout: Layout, redis_url: str, engine_flags: list[str]) -> Server:
    """Workers (loading in parallel), then the router once every worker is serving."""
    cluster = ["--redis-url", redis_url, "--cluster", layout.name]
    started = []
    for role, cores, threads in layout.workers:
        ready = procs.workdir / f"{layout.name}-{role}.ready"
        cmd = pdserve_command(role, "--host", HOST, "--worker-id", f"{role}-0", "--ready-file", str(ready),
                              "--num-threads", str(threads), *cluster, *engine_flags)
        started.append((procs.start(f"{layout.name}-{role}", cmd, cores=cores), ready))
    for proc, ready in started:
        wait_until(lambda: ready.exists() and bool(ready.read_text().strip()), proc, 600, "ready file")
    port, ready = free_port(), procs.workdir / f"{layout.name}-router.ready"
    router = procs.start(f"{layout.name}-router", pdserve_command(
        "router", "--host", HOST, "--port", str(port), "--grpc-port", "0", "--ready-file", str(ready),
        "--max-model-len", str(MAX_MODEL_LEN), *cluster, *layout.router_flags))
    base_url = f"http://{HOST}:{port}"
    wait_until(lambda: ready.exists() and http_ok(base_url + "/health"), router, 120, "ready router")
    return Server(layout.name, base_url, router)


def short_flags(load: Load, seed: int, slo: tuple[float, float]) -> tuple[str, ...]:
    return ("--dataset-name", "random", "--random-input-len", str(load.short_in), "--random-output-len",
            str(load.short_out), "--num-prompts", str(load.short_count), "--request-rate", str(load.short_rate),
            "--seed", str(seed), "--goodput", f"ttft:{slo[0]:g}", f"tpot:{slo[1]:g}")


def long_flags(load: Load, seed: int) -> tuple[str, ...]:
    return ("--dataset-name", "random", "--random-input-len", str(load.long_in), "--random-output-len",
            str(load.long_out), "--num-prompts", str(load.long_count), "--request-rate", str(load.long_rate),
            "--burstiness", str(load.burstiness), "--seed", str(seed))


COMMON = ("--endpoint", "/v1/completions", "--ignore-eos", "--temperature", "0", "--percentile-metrics",
          "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm")


@dataclass(frozen=True)
class Phases:
    """Bench JSON of one setup: short chats alone, short chats and the bursts beside them."""

    steady: dict
    bursts_short: dict
    bursts_long: dict


def run_setup(procs: Processes, server: Server, load: Load, slo: tuple[float, float], repeat: int) -> list[Phases]:
    """Warm-up (a long and a short prompt: first packing, first KV channel), then `repeat`
    rounds of the phases."""
    out, url, name = procs.workdir, server.base_url, server.label
    for kind, length, seed in (("long", load.long_in, 900), ("short", load.short_in, 901)):
        warm = ("--dataset-name", "random", "--random-input-len", str(length), "--random-output-len", "4",
                "--num-prompts", "2", "--seed", str(seed))  # sent at once; only their side effects matter
        run_bench(procs, f"{name}-warmup-{kind}", url, (*COMMON, *warm), out, BENCH_TIMEOUT_S)
    return [run_round(procs, server, load, slo, r) for r in range(repeat)]


def run_round(procs: Processes, server: Server, load: Load, slo: tuple[float, float], r: int) -> Phases:
    out, url, name, seed = procs.workdir, server.base_url, f"{server.label}-r{r}", 10 * r
    print(f"  {name}: steady short chats ...", flush=True)
    steady = run_bench(procs, f"{name}-steady", url, (*COMMON, *short_flags(load, seed + 1, slo)), out,
                       BENCH_TIMEOUT_S)
    print(f"  {name}: short chats with bursts of long prompts ...", flush=True)
    short = start_bench(procs, f"{name}-bursts-short", url, (*COMMON, *short_flags(load, seed + 2, slo)), out)
    time.sleep(BURST_DELAY_S)
    long = start_bench(procs, f"{name}-bursts-long", url, (*COMMON, *long_flags(load, seed + 3)), out)
    phases = Phases(steady, finish_bench(procs, short, BENCH_TIMEOUT_S), finish_bench(procs, long, BENCH_TIMEOUT_S))
    print(f"  {name}: ITL p99 steady {value(steady, 'p99_itl_ms'):.1f} ms, with bursts "
          f"{value(phases.bursts_short, 'p99_itl_ms'):.1f} ms", flush=True)
    return phases


def measure(layout: Layout, load: Load, slo: tuple[float, float], engine_flags: list[str], workdir: Path,
            repeat: int, own_sessions: bool = False) -> list[Phases]:
    """One setup from start to stop: its own Redis, workers, router and bench processes."""
    from pdserve.redis_server import EmbeddedRedis, share_cluster_secrets

    with others_on(layout.others), EmbeddedRedis() as redis, Processes(workdir, own_sessions=own_sessions) as procs:
        share_cluster_secrets(redis)
        server = start_setup(procs, layout, redis.url, engine_flags)
        return run_setup(procs, server, load, slo, repeat)


@contextlib.contextmanager
def others_on(cores: frozenset[int] | None):
    """This script on `cores` while a setup runs, so that what it starts without cores of its
    own (router, Redis, bench clients) inherits them; the workers' taskset overrides it."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# ------------------------------------------------------------------ report
def value(result: dict, field: str) -> float:
    number = result.get(field)
    return float(number) if number is not None else math.nan


def quotient(a: float, b: float) -> float:
    return a / b if b else (math.inf if a else math.nan)


def med(rounds: list[Phases], phase: str, field: str) -> float:
    return statistics.median(value(getattr(p, phase), field) for p in rounds)


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    """min / median / max."""
    return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def itl_ratios(rounds: list[Phases]) -> list[float]:
    """ITL p99 with bursts / steady, per round."""
    return [quotient(value(p.bursts_short, "p99_itl_ms"), value(p.steady, "p99_itl_ms")) for p in rounds]


def rows(results: dict[str, list[Phases]]) -> tuple[list[str], list[list[object]]]:
    headers = ["setup", "rounds", "ITL p99 steady ms (min/med/max)", "ITL p99 bursts ms (min/med/max)",
               "ITL bursts/steady per round (min/med/max)", "TTFT p99 steady ms", "TTFT p99 bursts ms",
               "long TTFT p99 ms", "goodput steady req/s", "goodput bursts req/s", "failed (steady/short/long)"]
    table = []
    for name, rounds in results.items():
        failed = [sum(p.steady["failed"] for p in rounds), sum(p.bursts_short["failed"] for p in rounds),
                  sum(p.bursts_long["failed"] for p in rounds)]
        table.append([name, len(rounds), spread([value(p.steady, "p99_itl_ms") for p in rounds]),
                      spread([value(p.bursts_short, "p99_itl_ms") for p in rounds]),
                      spread(itl_ratios(rounds), "{:.2f}x"),
                      f"{med(rounds, 'steady', 'p99_ttft_ms'):.1f}", f"{med(rounds, 'bursts_short', 'p99_ttft_ms'):.1f}",
                      f"{med(rounds, 'bursts_long', 'p99_ttft_ms'):.1f}",
                      f"{med(rounds, 'steady', 'request_goodput'):.2f}",
                      f"{med(rounds, 'bursts_short', 'request_goodput'):.2f}", "/".join(map(str, failed))])
    return headers, table


def goal_lines(results: dict[str, list[Phases]]) -> list[str]:
    col = results.get("colocated")
    met = lambda ok: "MET" if ok else "NOT MET"  # noqa: E731
    lines = []
    for name in (n for n in results if n.startswith("disaggregated")):
        dis = results[name]
        ratios = itl_ratios(dis)
        itl = statistics.median(ratios)
        col_itl = f"{statistics.median(itl_ratios(col)):.2f}x" if col else "not run"
        lines.append(f"- goal {name} ITL p99 with bursts <= {ITL_GOAL}x steady: median {itl:.2f}x over "
                     f"{len(ratios)} rounds (min/med/max {spread(ratios, '{:.2f}x')}) -> {met(itl <= ITL_GOAL)} "
                     f"(colocated: {col_itl})")
        if col is None:
            continue
        good = quotient(med(dis, "bursts_short", "request_goodput"), med(col, "bursts_short", "request_goodput"))
        lines += [
            f"- goal goodput with bursts {name} >= {GOODPUT_GOAL}x colocated: {good:.2f}x -> "
            f"{met(good >= GOODPUT_GOAL)} (medians)",
            f"- {name}: steady goodput / colocated "
            f"{quotient(med(dis, 'steady', 'request_goodput'), med(col, 'steady', 'request_goodput')):.2f}x; "
            f"short-chat output tok/s with bursts {med(dis, 'bursts_short', 'output_throughput'):.1f} "
            f"(colocated {med(col, 'bursts_short', 'output_throughput'):.1f})",
        ]
    return lines


def gap_lines(results: dict[str, list[Phases]]) -> list[str]:
    """Per setup, the bursts phase's short-chat gaps split by what the long prompts were doing
    (benchmarks/burst_gaps.py): each class's share of the gaps and its p99 against the same
    round's steady p99 (min / median / max over the rounds)."""
    lines = []
    for name, rounds in results.items():
        per_round = [(gap_classes(p.bursts_short, p.bursts_long), value(p.steady, "p99_itl_ms")) for p in rounds]
        parts = []
        for i, cls in enumerate(CLASSES):
            shares = [classes[i].share * 100 for classes, _ in per_round]
            ratios = [quotient(classes[i].p99_ms, steady) for classes, steady in per_round
                      if not math.isnan(classes[i].p99_ms)]
            ratio = f"p99 {spread(ratios, '{:.2f}x')} steady" if ratios else "no gaps"
            parts.append(f"{cls}: {spread(shares, '{:.0f}')}% of gaps, {ratio}")
        lines.append(f"- {name}, the bursts phase's short-chat gaps by what the long prompts were doing "
                     f"(min / med / max over rounds): " + "; ".join(parts))
        batches = batch_summary([p.steady for p in rounds], [(p.bursts_short, p.bursts_long) for p in rounds])
        same = ", ".join(f"{n}: {r:.2f}x" for n, r in batches.median_ratios) or "no batch size with enough gaps"
        lines.append(f"- {name}, gaps by the decode batch they fell in (rounds pooled): median gap with bursts / "
                     f"steady at the same number of short chats decoding and no long prompt: {same}; gaps in "
                     f"batches of {BIG_BATCH} or more short chats: {batches.big_steady * 100:.0f}% steady, "
                     f"{batches.big_bursts * 100:.0f}% with bursts")
    return lines


def method_lines(load: Load, slo: tuple[float, float], engine_flags: list[str], all_layouts: list[Layout],
                 own_sessions: bool = False) -> list[str]:
    setups = "; ".join(f"{lay.name}: " + ", ".join(f"{role} on core(s) {cores} with {threads} thread(s)"
                                                     for role, cores, threads in lay.workers)
                       + (f" (router `{' '.join(lay.router_flags)}`)" if lay.router_flags else "")
                       + (f", router, Redis and bench clients on core(s) {','.join(map(str, sorted(lay.others)))}"
                          if lay.others is not None else "")
                       for lay in all_layouts)
    return [
        f"- setups: {setups}; router, Redis and bench clients unpinned unless a setup says otherwise; engine flags "
        f"`{' '.join(engine_flags)}`",
        *load.describe(),
        f"- SLO for goodput (short chats): TTFT <= {slo[0]:g} ms and TPOT <= {slo[1]:g} ms",
        "- ITL = gaps between streamed tokens of the short chats (p99 over all gaps of the phase); TTFT p99 of "
        "the short chats; long TTFT = the bursts' own TTFT p99",
        "- gaps by what the long prompts were doing (benchmarks/burst_gaps.py): a short chat's gap overlapping a "
        "long prompt's decode (its first token -> its last: in the same decode batch) is `long decoding`; else one "
        "overlapping a long prompt's prefill (sent -> first token: its KV computed, sent and written) is `long "
        "arriving`; else `neither`",
        "- gaps by decode batch (benchmarks/burst_gaps.py): each gap counted under the short chats and long prompts "
        "decoding (first token -> last token) at its midpoint; a batch size is compared when it has "
        f"at least {MIN_GAPS} gaps in both phases",
        "- load: `pdserve bench " + " ".join(COMMON) + " --base-url URL <stream flags>`; one untimed warm-up "
        "per setup (2 long + 2 short prompts, other seeds)",
        "- sessions: " + ("each process in a session of its own (--own-sessions)" if own_sessions else
                          "every process in this script's session, a process group each (the engines' nice ranks them "
                          "below the router and the clients under autogroup scheduling too)"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run; nothing is appended to RESULTS.md")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--quantization", choices=("auto", "none", "gguf", "int8", "int4"), default="auto",
                        help="the workers' --quantization (auto: dense on a CPU without AVX512-BF16)")
    parser.add_argument("--int4-activations", choices=("auto", "bfloat16", "int8"), default="auto",
                        help="the workers' --int4-activations (auto, their default: int8 where the CPU runs it)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of both phases per setup (spread reported)")
    parser.add_argument("--setups", default="", help="comma-separated subset of the setups to run (default: all)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument("--own-sessions", action="store_true",
                        help="start each process in a session of its own (the layout of the earlier runs)")
    args = parser.parse_args()
    exit_on_sigterm()
    load, slo = (QUICK if args.quick else FULL), (args.slo_ttft_ms, args.slo_tpot_ms)
    engine_flags = ["--dtype", args.dtype, "--quantization", args.quantization,
                    "--int4-activations", args.int4_activations, "--max-model-len", str(MAX_MODEL_LEN)]
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-disagg-vs-colocated-"))
    print(f"work dir (logs, bench JSON): {workdir}", flush=True)
    all_layouts = layouts()
    if args.setups:
        wanted = set(args.setups.split(","))
        unknown = wanted - {lay.name for lay in all_layouts}
        if unknown:
            parser.error(f"unknown setups {sorted(unknown)}; known: {[lay.name for lay in all_layouts]}")
        all_layouts = [lay for lay in all_layouts if lay.name in wanted]
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    results = {lay.name: measure(lay, load, slo, engine_flags, workdir, args.repeat, args.own_sessions)
               for lay in all_layouts}

    headers, table = rows(results)
    goals = goal_lines(results) + gap_lines(results)
    method = method_lines(load, slo, engine_flags, all_layouts, args.own_sessions)
    print("\n" + text_table(headers, table) + "\n\n" + "\n".join(goals) + "\n\nMethod:\n" + "\n".join(method))
    if args.quick or args.no_results:
        print("\n(quick/no-results run: RESULTS.md left alone)")
        return 0
    importlib.import_module("torch")  # only so that the results header lists its version

    body = "\n".join([markdown_table(headers, table), "", *goals, "", "Method:", "", *method])
    title = args.dtype if (args.quantization, args.int4_activations) == ("auto", "auto") else (
        f"{args.dtype}, --quantization {args.quantization}, --int4-activations {args.int4_activations}")
    path = append_results(f"disagg_vs_colocated ({title})", body)
    print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
