"""Memory over a long mixed load: does every process of a `pdserve up` cluster level off?

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--warmup-minutes 5] [--concurrency 4] ...

Method (printed with the results too):

- Cluster: `pdserve up` (1 prefill + 1 decode, the default model, a small KV cache) started
  the way tests/e2e does it (tests/e2e/cluster.py), on free 127.0.0.1 ports. When
  PDSERVE_API_KEY is set in this script's environment the cluster inherits it (never argv) and
  every request sends `Authorization: Bearer <key>`.
- Load: --concurrency closed-loop clients for --minutes, each drawing at random: chat or
  completions, streamed or not, a prompt of 8..~600 words, max_tokens from {8, 32, 96}. A share
  of streamed requests (--cancel-share) is cancelled mid-way: the client closes the connection
  after 1..6 chunks. Requests counted ok / failed / cancelled.
- Memory: every --interval seconds, RSS (VmRSS) and PSS / USS (from /proc/<pid>/smaps_rollup)
  of every process under `pdserve up` (router, each worker, redis-server, the supervisor).
  Slope = least-squares fit of RSS (MB) over minutes, on the samples after --warmup-minutes
  (and the same for RssAnon: RSS without the file pages of the mapped weights, which the
  kernel drops and reloads under memory pressure, so RSS alone can fall by 100+ MB at once);
  the same fit on the first and second half of those samples says whether growth slows down
  (levels off) or keeps its pace. Goal: < 1 MB/min after warm-up.
- Blocks: once the load stops and the workers are idle, every worker's blocks (total, free,
  reserved), requests running/waiting and KV usage from /v1/cluster and from the worker's own
  /metrics: all blocks must be free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import httpx  # noqa: E402

from benchmarks.common import append_results, markdown_table, text_table  # noqa: E402
from tests.e2e.cluster import RunningCluster, start_cluster  # noqa: E402

GOAL_MB_PER_MIN = 1.0
MAX_TOKENS = (8, 32, 96)
WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers debug a "
         "paged cache under load and count every block twice before the soak ends").split()


@dataclass(frozen=True)
class Sample:
    t_s: float
    process: str
    pid: int
    rss_mb: float
    anon_mb: float
    """RssAnon: heap and other private memory, what a leak grows; RSS also counts file pages
    (the model's mapped weights) that the kernel drops and reloads under memory pressure."""
    pss_mb: float | None
    uss_mb: float | None


@dataclass
class Counts:
    ok: int = 0
    failed: int = 0
    cancelled: int = 0
    errors: dict[str, int] | None = None

    def fail(self, what: str) -> None:
        self.failed += 1
        self.errors = self.errors or {}
        self.errors[what] = self.errors.get(what, 0) + 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="length of the load")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="samples before this are not fitted")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--concurrency", type=int, default=4, help="clients at once")
    p.add_argument("--cancel-share", type=float, default=0.15, help="share of streamed requests cancelled")
    p.add_argument("--kv-cache-memory", default="256MiB", help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the samples here (.json or .csv)")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    p.add_argument("--up-flag", action="append", default=[], help="extra flag for pdserve up (repeatable)")
    return p.parse_args(argv)


# ------------------------------------------------------------------ processes and memory
def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(_children(pid))
    return out


def process_name(pid: int) -> str | None:
    """router / prefill:<id> / decode:<id> / redis-server / up, from the command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv if a]
    if not args:
        return None
    if "redis-server" in args[0]:
        return "redis-server"
    for role in ("router", "prefill", "decode", "up"):
        if role in args:
            worker = args[args.index("--worker-id") + 1] if "--worker-id" in args else None
            return f"{role}:{worker}" if worker else role
    return None


def memory_mb(pid: int) -> tuple[float, float, float | None, float | None] | None:
    """(RSS, RssAnon, PSS, USS) in MB; None once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    anon = int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) / 1024
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        kb = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", rollup, re.M)}
        return rss, anon, kb["Pss"] / 1024, (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024
    except (OSError, KeyError):
        return rss, anon, None, None


class Sampler(threading.Thread):
    """Samples every process under `root` each `interval` seconds until stopped."""

    def __init__(self, root: int, interval: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.root, self.interval = root, interval
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample_once()
            self._halt.wait(self.interval)

    def sample_once(self) -> None:
        t = time.monotonic() - self.t0
        for pid in descendants(self.root):
            name, mem = process_name(pid), memory_mb(pid)
            if name is not None and mem is not None:
                self.samples.append(Sample(round(t, 2), name, pid, *mem))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


# ------------------------------------------------------------------ load
def prompt(rng: random.Random) -> str:
    n = rng.choice((8, 40, 150, 600)) + rng.randrange(8)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def request_body(rng: random.Random, model: str) -> tuple[str, dict]:
    max_tokens, stream = rng.choice(MAX_TOKENS), rng.random() < 0.6
    common = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": 0.8,
              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt(rng)}]}
    return "/v1/completions", {**common, "prompt": prompt(rng)}


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, cancel_share: float,
                      counts: Counts) -> None:
    path, body = request_body(rng, model)
    try:
        if not body["stream"]:
            r = await client.post(path, json=body)
            counts.ok += 1 if r.status_code == 200 else 0
            if r.status_code != 200:
                counts.fail(f"HTTP {r.status_code}")
            return
        cancel_after = rng.randint(1, 6) if rng.random() < cancel_share else None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                counts.fail(f"HTTP {r.status_code}")
                return
            chunks = 0
            async for line in r.aiter_lines():
                if '"error"' in line:
                    counts.fail("in-band error")
                    return
                chunks += line.startswith("data: {")
                if cancel_after is not None and chunks >= cancel_after:
                    counts.cancelled += 1
                    return  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    counts.ok += 1
                    return
            counts.fail("stream ended without [DONE]")
    except httpx.HTTPError as exc:
        counts.fail(type(exc).__name__)


async def run_load(base_url: str, headers: dict[str, str], minutes: float, concurrency: int,
                   cancel_share: float, seed: int) -> Counts:
    counts = Counts()
    deadline = time.monotonic() + minutes * 60
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def client_loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_request(client, rng, model, cancel_share, counts)

        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return counts


# ------------------------------------------------------------------ blocks at the end
WORKER_GAUGES = ("pdserve_kv_blocks_total", "pdserve_kv_blocks_free", "pdserve_kv_blocks_reserved",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def worker_gauges(metrics_address: str, headers: dict[str, str]) -> dict[str, float]:
    text = httpx.get(f"http://{metrics_address}/metrics", headers=headers, timeout=10).text
    out = {}
    for name in WORKER_GAUGES:
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def block_rows(cluster: RunningCluster, headers: dict[str, str], idle_timeout_s: float = 90) -> list[list]:
    """Per worker: /v1/cluster's and its own /metrics' blocks, once idle (or at the timeout)."""
    deadline = time.monotonic() + idle_timeout_s
    while True:
        view = httpx.get(f"{cluster.base_url}/v1/cluster", headers=headers, timeout=10).json()
        workers = view["workers"]
        idle = all(w["free_blocks"] == w["total_blocks"] and w["reserved_blocks"] == 0 for w in workers)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(2)
    rows = []
    for w in workers:
        g = worker_gauges(w["metrics_address"], headers)
        all_free = (g["pdserve_kv_blocks_free"] == g["pdserve_kv_blocks_total"]
                    and g["pdserve_kv_blocks_reserved"] == 0 and g["vllm:num_requests_running"] == 0
                    and g["vllm:num_requests_waiting"] == 0)
        rows.append([w["worker_id"], w["role"], w["total_blocks"], w["free_blocks"], w["reserved_blocks"],
                     int(g["pdserve_kv_blocks_free"]), int(g["pdserve_kv_blocks_reserved"]),
                     int(g["vllm:num_requests_running"]), int(g["vllm:num_requests_waiting"]),
                     f"{g['vllm:kv_cache_usage_perc']:.3f}", "yes" if all_free else "NO"])
    return rows


# ------------------------------------------------------------------ fitting and reporting
def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute (nan under 3 points)."""
    if len(points) < 3:
        return float("nan")
    n = len(points)
    mt, mm = sum(t for t, _ in points) / n, sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    cov = sum((t - mt) * (m - mm) for t, m in points)
    return cov / var * 60 if var else float("nan")


def memory_rows(samples: list[Sample], warmup_s: float) -> list[list]:
    rows = []
    for name in sorted({s.process for s in samples}):
        mine = [s for s in samples if s.process == name]
        fit = [(s.t_s, s.rss_mb) for s in mine if s.t_s >= warmup_s]
        half = len(fit) // 2
        slope = slope_mb_per_min(fit)
        anon = [(s.t_s, s.anon_mb) for s in mine if s.t_s >= warmup_s]
        verdict = "n/a" if slope != slope else ("met" if slope < GOAL_MB_PER_MIN else "NOT MET")
        rows.append([name, f"{mine[0].rss_mb:.1f}", f"{mine[-1].rss_mb:.1f}", f"{max(s.rss_mb for s in mine):.1f}",
                     f"{slope:.2f}", f"{slope_mb_per_min(fit[:half]):.2f}", f"{slope_mb_per_min(fit[half:]):.2f}",
                     f"{slope_mb_per_min(anon):.2f}", verdict])
    return rows


MEMORY_HEADERS = ["process", "RSS start MB", "RSS end MB", "RSS max MB", "slope MB/min",
                  "1st half", "2nd half", "anon slope", f"< {GOAL_MB_PER_MIN:g} MB/min"]
BLOCK_HEADERS = ["worker", "role", "total", "free (view)", "reserved (view)", "free (/metrics)",
                 "reserved (/metrics)", "running", "waiting", "kv usage", "all free"]


def write_samples(path: Path, samples: list[Sample]) -> None:
    if path.suffix == ".csv":
        fields = list(Sample.__dataclass_fields__)
        lines = [",".join(fields)] + [",".join(str(getattr(s, f)) for f in fields) for s in samples]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(json.dumps([asdict(s) for s in samples]))


def method(args: argparse.Namespace) -> str:
    return (f"Method: `pdserve up` (1 prefill + 1 decode, default model, --kv-cache-memory "
            f"{args.kv_cache_memory}) on 127.0.0.1; {args.concurrency} closed-loop clients for "
            f"{args.minutes:g} min: chat or completions, streamed (60%) or not, prompts of 8..~600 words, "
            f"max_tokens in {MAX_TOKENS}, {args.cancel_share:.0%} of streams closed after 1..6 chunks. "
            f"RSS/PSS/USS of every process every {args.interval:g} s (/proc/<pid>/status, smaps_rollup); "
            f"slope = least squares of RSS (and of RssAnon, which leaves out file pages the kernel may drop) over time after a {args.warmup_minutes:g}-min warm-up, also on "
            f"each half of those samples (a 2nd half near 0 = levelled off). Blocks read once idle, from "
            f"/v1/cluster and each worker's /metrics. The machine's cores are shared with other work, "
            f"so short runs give noisy slopes.")


def report(args, samples: list[Sample], counts: Counts, blocks: list[list], load_minutes: float) -> str:
    mem = memory_rows(samples, args.warmup_minutes * 60)
    print(text_table(MEMORY_HEADERS, mem), "\n")
    print(text_table(BLOCK_HEADERS, blocks), "\n")
    summary = (f"- requests: {counts.ok} ok, {counts.failed} failed, {counts.cancelled} cancelled "
               f"(over {load_minutes:.1f} min; failures: {counts.errors or {}})\n"
               f"- blocks all free once idle: {'yes' if all(r[-1] == 'yes' for r in blocks) else 'NO'}")
    print(summary)
    return "\n\n".join([markdown_table(MEMORY_HEADERS, mem), markdown_table(BLOCK_HEADERS, blocks),
                        summary, method(args)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `timeout` / kill send SIGTERM: unwind through the finally below so the cluster is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    key = os.environ.get("PDSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        # Prompts of up to ~600 words and 96 new tokens: 2048 tokens a request is enough, and the
        # default model's 8192 would not fit the small KV budget (pdserve up refuses to start).
        cluster = start_cluster(Path(tmp), "--prefill", "1", "--decode", "1", "--max-model-len", "2048",
                                "--kv-cache-memory", args.kv_cache_memory, *args.up_flag)
        sampler = Sampler(cluster.process.pid, args.interval)
        try:
            sampler.start()
            started = time.monotonic()
            counts = asyncio.run(run_load(cluster.base_url, headers, args.minutes, args.concurrency,
                                          args.cancel_share, args.seed))
            load_minutes = (time.monotonic() - started) / 60
            blocks = block_rows(cluster, headers)
        finally:
            sampler.stop()
            pids = descendants(cluster.process.pid)
            cluster.stop()
            for pid in pids[1:]:  # anything the supervisor left behind (it should leave nothing)
                if process_name(pid) is not None:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
    body = report(args, sampler.samples, counts, blocks, load_minutes)
    if args.out:
        write_samples(args.out, sampler.samples)
    if not args.no_results:
        print("appended to", append_results(f"soak ({args.minutes:g} min)", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
