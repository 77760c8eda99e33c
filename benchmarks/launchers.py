"""`pdserve up` with local processes vs on Ray: time to first answer and memory per component,
side by side in one run.

    .venv/bin/python benchmarks/launchers.py [--rounds 2] [--kv-cache-memory 256MiB] [--no-results]

Method (printed with the results too):

- Each round starts `pdserve up --prefill 1 --decode 1` (the default model, a small KV cache,
  free 127.0.0.1 ports), then `pdserve up --launcher ray` with the same flags (a local Ray
  instance it starts itself; --prefill-num-cpus/--decode-num-cpus 1), one after the other,
  never both at once. The launchers alternate first place from round to round.
- Time to first answer: from starting the command to the first 200 of a greedy 8-token
  /v1/completions, polled every 0.1 s: everything a user waits for (Ray's own start included).
- Memory: RSS (VmRSS) of each process under the command, read once the first answer came and
  the cluster is idle, grouped by component: router, prefill worker, decode worker, Redis
  (server, and its actor on Ray), the launcher (`pdserve up` itself; on Ray also the
  controller actor), and Ray's own processes (GCS, raylet, dashboard, agents, idle workers).
  RSS counts shared pages (the torch libraries) in every process that maps them.
- The tables show the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import httpx  # noqa: E402

from benchmarks.common import append_results, markdown_table, text_table  # noqa: E402
from benchmarks.peers.servers import exit_on_sigterm  # noqa: E402
from tests.e2e.cluster import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("router", "prefill", "decode", "redis", "launcher", "ray itself")
START_TIMEOUT_S = 600.0


def descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def component_of(pid: int, root: int, actor_pids: dict[int, str]) -> str:
    """Which component a process under `pdserve up` belongs to."""
    if pid == root:
        return "launcher"
    if pid in actor_pids:
        return actor_pids[pid]
    line = cmdline(pid)
    if "redis-server" in line:
        return "redis"
    for name in ("router", "prefill", "decode"):
        if f"-m pdserve {name}" in line:
            return name
    return "ray itself"


def actor_pids(log: str) -> dict[int, str]:
    """Ray actor pids from the driver's log prefixes: `(decode-0 pid=123)`."""
    out = {}
    for name, pid in re.findall(r"\((\w[\w-]*) pid=(\d+)(?:, ip=[^)]*)?\)", log):
        role = name.split("-")[0]
        out[int(pid)] = {"controller": "launcher"}.get(role, role)
    return out


def one_run(launcher: str, kv: str) -> tuple[float, dict[str, float]]:
    port, grpc = free_ports(2)
    # --max-model-len: a 256 MiB cache holds 5,824 tokens where the KV is float32 (a CPU
    # without AVX-512 BF16), less than the model's 8,192; the launchers' memory is the point.
    flags = ["--prefill", "1", "--decode", "1", "--kv-cache-memory", kv, "--max-model-len", "4096",
             "--port", str(port), "--grpc-port", str(grpc)]
    if launcher == "ray":
        flags += ["--launcher", "ray"]
    log_path = Path(tempfile.mkstemp(prefix=f"launchers-{launcher}-", suffix=".log")[1])
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *flags], cwd=ROOT, stdout=log_path.open("w"),
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = None
        while first is None and time.monotonic() - started < START_TIMEOUT_S:
            if process.poll() is not None:
                raise RuntimeError(f"{launcher}: pdserve up exited:\n{log_path.read_text()[-3000:]}")
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={
                    "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
                    "temperature": 0})
                if r.status_code == 200:
                    first = time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if first is None:
            raise RuntimeError(f"{launcher}: no answer within {START_TIMEOUT_S:.0f} s")
        time.sleep(3)  # idle: the first answer's buffers settled, Ray's idle workers started
        actors = actor_pids(log_path.read_text())
        memory = {name: 0.0 for name in COMPONENTS}
        for pid in descendants(process.pid):
            memory[component_of(pid, process.pid, actors)] += rss_mb(pid)
        return first, memory
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
        log_path.unlink(missing_ok=True)


def main() -> int:
    exit_on_sigterm()  # SIGTERM unwinds, so the clusters started below are stopped
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each launcher (alternating order)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache of each worker")
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, dict[str, float]]]] = {"local": [], "ray": []}
    for round_ in range(args.rounds):
        order = ("local", "ray") if round_ % 2 == 0 else ("ray", "local")
        for launcher in order:
            results[launcher].append(one_run(launcher, args.kv_cache_memory))
            first, memory = results[launcher][-1]
            print(f"round {round_ + 1} {launcher}: first answer {first:.1f} s, RSS "
                  + ", ".join(f"{k} {v:.0f} MB" for k, v in memory.items()), flush=True)

    def median(launcher: str, key: str | None) -> float:
        values = [first if key is None else memory[key] for first, memory in results[launcher]]
        return statistics.median(values)

    rows = [["time to first answer (s)", f"{median('local', None):.1f}", f"{median('ray', None):.1f}",
             f"{median('ray', None) / median('local', None):.2f}"]]
    for key in COMPONENTS:
        local, ray_ = median("local", key), median("ray", key)
        rows.append([f"RSS {key} (MB)", f"{local:.0f}", f"{ray_:.0f}", f"{ray_ / local:.2f}" if local else "-"])
    total = {name: statistics.median(sum(m.values()) for _, m in results[name]) for name in results}
    rows.append(["RSS total (MB)", f"{total['local']:.0f}", f"{total['ray']:.0f}", f"{total['ray'] / total['local']:.2f}"])
    headers = ["", "local processes", "Ray actors", "Ray / local"]
    print(text_table(headers, rows))
    method = __doc__.split("Method (printed with the results too):")[1].strip()
    if args.no_results:
        print("(RESULTS.md left alone)")
        return 0
    path = append_results("pdserve up: local processes vs Ray actors",
                          f"{markdown_table(headers, rows)}\n\nMedian of {args.rounds} rounds.\n\n{method}\n")
    print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
