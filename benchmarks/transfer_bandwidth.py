"""KV transfer bandwidth of our gloo data plane vs raw gloo, and TTFT disaggregated vs colocated.

    .venv/bin/python benchmarks/transfer_bandwidth.py [--sizes 1024,4096,16384] [--repeat 3]
                                                      [--overlap-sizes 1024,4096]
                                                      [--skip-ttft] [--no-results]

Method (printed with the results too):

- transfer: the receiver (D) runs in a spawned child, the sender (P) in this process, both on
  127.0.0.1; a multiprocessing Pipe carries only commands and timestamps. The KV shape is the
  default model's (read from its GGUF), float32, blocks of EngineConfig().block_size tokens.
  Per prompt size, P packs that many tokens' blocks (scattered block ids) out of a cache with
  `pack_blocks` and sends them through `GlooBackend` (doorbell in D's TCPStore, header,
  payload as one frame per layer, trailer, ack). Between the same two processes, in the same run, a plain ProcessGroupGloo
  (its own TCPStore rendezvous on a free port) sends one float32 tensor of the same bytes.
  raw: from P's send() to D's recv().wait() returning, with D's recv posted beforehand into
  a buffer it has already touched (CLOCK_MONOTONIC is shared by both processes).
  ours: P's TransferResult.seconds, what the data plane itself reports: doorbell -> header
  -> payload -> D's ack back at P; D recycles each payload once polled, as a decode worker
  does after importing its blocks. Every repeat does ours, raw and raw into a fresh buffer
  back to back; the tables show medians.
- overlap: with the same D child and channel, a real prefill (default model, float32) per prompt
  size, its KV sent one-shot after the first token and layer by layer during the forward pass;
  the share of the transfer hidden behind the prefill's compute (benchmarks/transfer_overlap.py).
- TTFT: `pdserve up` (disaggregated: 1 prefill + 1 decode worker; colocated: 1 worker), one
  cluster at a time; streaming POST /v1/completions with token-id prompts, max_tokens 8,
  temperature 0, ignore_eos; TTFT = request sent -> first chunk with a choice. One warm-up
  request per cluster, then fresh random prompts (the same ones in both modes), so the
  prefix cache serves none of them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402
from torch.distributed import ProcessGroupGloo, TCPStore  # noqa: E402

from benchmarks.common import append_results, markdown_table, run_header, text_table  # noqa: E402
from benchmarks.peers.servers import exit_on_sigterm  # noqa: E402
from benchmarks.transfer_overlap import OVERLAP_HEADERS, overlap_rows, run_overlap  # noqa: E402

HOST = "127.0.0.1"
GOAL = 0.80
"""Minimum ratio ours/raw gloo bandwidth, per size."""
RAW_TAG = 7
POLL_S = 0.001
"""How often P and D poll their ends, about once per worker loop step. Polling much faster
(0.2 ms) takes enough of a 2-core host from the gloo threads to slow the transfers down."""
WIRE_TIMEOUT_S = 120.0  # a 16k-token payload (755 MB) on a loaded 2-core host stays well inside
TTFT_LENGTHS = (1000, 4000)
TTFT_MAX_TOKENS = 8
CLUSTER_FLAGS = ("--dtype", "float32", "--max-model-len", "8192", "--kv-cache-memory", "1GiB")
MODES = {"disaggregated": ("--prefill", "1", "--decode", "1"), "colocated": ("--colocated", "--decode", "1")}


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------ KV shape
@dataclass(frozen=True)
class KVShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    itemsize: int = 4  # float32

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def default_kv_shape() -> KVShape:
    from engine.config import EngineConfig
    from engine.loader.locate import default_model_path
    from engine.loader.spec_reader import read_spec

    spec = read_spec(default_model_path())
    return KVShape(spec.num_layers, EngineConfig().block_size, spec.num_kv_heads, spec.head_dim)


# -------------------------------------------------------- both ends, raw gloo
def raw_group(port: int, rank: int) -> tuple[TCPStore, ProcessGroupGloo]:
    """A plain 2-rank gloo group bound to HOST; rank 0 (P) hosts the TCPStore."""
    store = TCPStore(HOST, port, 2, rank == 0, timedelta(seconds=60))
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = timedelta(seconds=WIRE_TIMEOUT_S)
    return store, ProcessGroupGloo(store, rank, 2, options)


# ------------------------------------------------------------- D, the child
def decode_side(conn, raw_port: int) -> None:
    """The spawned child. Commands on `conn` (answers in brackets):
    ("raw", numel, fresh) [("ready",), then ("raw_done", t_received)];
    ("ours",) [("ours_done", ticket, state, nbytes, d_seconds, t_polled, error)]; ("stop",)."""
    try:
        from kv_transfer.base import TransferConfig
        from kv_transfer.gloo import GlooBackend
        from proto.auth import load_cluster_secret

        config = TransferConfig(host=HOST, timeout_s=WIRE_TIMEOUT_S, connect_timeout_s=60.0,
                                secret=load_cluster_secret())
        receiver = GlooBackend(config).open_receiver()
        try:
            address = receiver.open_channel()
            conn.send(("address", address.host, address.port, address.channel_id))
            _store, group = raw_group(raw_port, rank=1)
            serve_commands(conn, receiver, group)
        finally:
            receiver.close()
    except BaseException:  # noqa: BLE001 - tell P why, instead of leaving it waiting
        conn.send(("error", traceback.format_exc()))


def serve_commands(conn, receiver, group: ProcessGroupGloo) -> None:
    touched: torch.Tensor | None = None  # the raw buffer reused across repeats of one size
    while (msg := conn.recv())[0] != "stop":
        if msg[0] == "raw":
            _, numel, fresh = msg
            if fresh:
                buf = torch.empty(numel, dtype=torch.float32)
            else:
                if touched is None or touched.numel() != numel:
                    touched = None  # free the previous size's buffer first
                    touched = torch.zeros(numel, dtype=torch.float32)
                buf = touched
            work = group.recv([buf], 0, RAW_TAG)  # posted before P is told to send
            conn.send(("ready",))
            work.wait()
            conn.send(("raw_done", time.perf_counter()))
            del buf
        elif msg[0] == "ours":
            got = []
            while not got:
                got = receiver.poll()
                if not got:
                    time.sleep(POLL_S)
            polled = time.perf_counter()
            (kv,) = got
            r = kv.result
            conn.send(("ours_done", r.ticket_id, r.state.value, r.nbytes, r.seconds, polled,
                       r.error))
            if kv.payload is not None:  # as a decode worker does once it imported the blocks
                receiver.recycle(kv.payload)
            del got, kv
        else:
            raise ValueError(f"unknown command {msg!r}")


class DecodeProcess:
    """P's handle on the D child: start, ask, answer, stop."""

    def __init__(self, raw_port: int) -> None:
        from proto.auth import CLUSTER_SECRET_ENV, generate_secret

        os.environ.setdefault(CLUSTER_SECRET_ENV, generate_secret())  # both ends prove it
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=decode_side, args=(child_conn, raw_port), daemon=True)
        self.proc.start()
        child_conn.close()

    def ask(self, *msg: object) -> None:
        self.conn.send(msg)

    def answer(self, timeout_s: float = WIRE_TIMEOUT_S + 30) -> tuple:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"no answer from D in {timeout_s}s (exit code {self.proc.exitcode})")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"D failed:\n{msg[1]}")
        return msg

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.proc.join(30)
        except OSError:
            pass  # the pipe broke: D is gone already
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
            self.conn.close()


# -------------------------------------------------------------- P, measuring
@dataclass(frozen=True)
class Ours:
    pack_s: float
    """pack_blocks on P (not part of the ratio)."""
    wire_s: float
    """P's TransferResult.seconds: doorbell -> header -> payload -> ack back."""
    d_side_s: float
    """D's TransferResult.seconds: header recv -> payload recv (into a fresh payload) -> ack sent."""
    to_poll_s: float
    """P's send() call -> D's poll() returning the payload (includes up to POLL_S of polling)."""


@dataclass
class SizeResult:
    tokens: int
    nbytes: int
    ours: list[Ours]
    raw_s: list[float]
    raw_fresh_s: list[float]

    @property
    def ours_gbps(self) -> float:
        return self.nbytes / statistics.median(o.wire_s for o in self.ours) / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.nbytes / statistics.median(self.raw_s) / 1e9

    @property
    def ratio(self) -> float:
        return self.ours_gbps / self.raw_gbps


class Bench:
    """P's side: a cache to pack from, our sender and the raw group, all to one D child."""

    def __init__(self, shape: KVShape, max_tokens: int, child: DecodeProcess, raw, seed: int) -> None:
        from kv_transfer.base import ChannelAddress, TransferConfig
        from kv_transfer.gloo import GlooBackend
        from proto.auth import load_cluster_secret

        self.shape, self.child, self.raw = shape, child, raw
        self.cache_blocks = shape.blocks(max_tokens) + 64
        # Touched (filled) caches, so pack_blocks reads real pages, not the shared zero page.
        self.caches = [torch.full(shape.cache_shape(self.cache_blocks), float(layer))
                       for layer in range(shape.num_layers)]
        self.rng = random.Random(seed)
        _, host, port, channel_id = child.answer()
        config = TransferConfig(host=HOST, timeout_s=WIRE_TIMEOUT_S, connect_timeout_s=60.0,
                                secret=load_cluster_secret())
        self.sender = GlooBackend(config).connect(ChannelAddress(host, port, channel_id))
        self.tickets = itertools.count(1)

    def close(self) -> None:
        self.sender.close()

    def block_ids(self, tokens: int) -> list[int]:
        """Scattered ids, as a cache looks after some churn."""
        return self.rng.sample(range(self.cache_blocks), self.shape.blocks(tokens))

    def ours_once(self, block_ids: list[int]) -> tuple[Ours, torch.Tensor]:
        from kv_transfer.base import TransferState
        from kv_transfer.packing import make_header, pack_blocks

        start = time.perf_counter()
        payload = pack_blocks(self.caches, block_ids)
        pack_s = time.perf_counter() - start
        ticket = next(self.tickets)
        self.child.ask("ours")
        sent = time.perf_counter()
        self.sender.send(make_header(ticket, 0, payload), payload)
        results, deadline = [], time.monotonic() + WIRE_TIMEOUT_S + 10
        while not results and time.monotonic() < deadline:
            results = self.sender.poll()
            time.sleep(POLL_S)
        _, d_ticket, d_state, d_nbytes, d_seconds, polled, d_error = self.child.answer()
        if not results or results[0].state is not TransferState.DONE or d_state != "done":
            raise RuntimeError(f"ticket {ticket} failed: P {results}, D {d_state} {d_error}")
        assert (d_ticket, d_nbytes, results[0].nbytes) == (ticket, payload.nbytes, payload.nbytes), (
            f"D received ticket {d_ticket} of {d_nbytes} bytes, P sent {ticket} of {payload.nbytes}")
        return Ours(pack_s, results[0].seconds, d_seconds, polled - sent), payload

    def raw_once(self, payload: torch.Tensor, fresh: bool) -> float:
        flat = payload.view(-1)
        self.child.ask("raw", flat.numel(), fresh)
        self.child.answer()  # ready: D's recv is posted
        start = time.perf_counter()
        self.raw.send([flat], 1, RAW_TAG).wait()
        (_, received) = self.child.answer()
        return received - start

    def measure(self, tokens: int, repeat: int) -> SizeResult:
        ids = self.block_ids(tokens)
        _, payload = self.ours_once(ids)  # warm-up (the first one also forms the channel)
        self.raw_once(payload, fresh=False)
        result = SizeResult(tokens, payload.nbytes, [], [], [])
        for run in range(repeat):
            del payload  # free the last one before packing the next
            ours, payload = self.ours_once(self.block_ids(tokens))
            result.ours.append(ours)
            result.raw_s.append(self.raw_once(payload, fresh=False))
            result.raw_fresh_s.append(self.raw_once(payload, fresh=True))
            print(f"  {tokens} tokens run {run + 1}/{repeat}: ours {payload.nbytes / ours.wire_s / 1e9:.2f} "
                  f"GB/s, raw {payload.nbytes / result.raw_s[-1] / 1e9:.2f} GB/s", flush=True)
        return result

    def empty_transfer_s(self, count: int) -> float:
        """Median P-side seconds of a 0-block transfer: doorbell + header + ack, no payload."""
        return statistics.median(self.ours_once([])[0].wire_s for _ in range(count))


def run_transfers(shape: KVShape, sizes: list[int], repeat: int, seed: int,
                  overlap_sizes: list[int]) -> tuple[list[SizeResult], float, list]:
    from tests.e2e.cluster import free_port

    port = free_port()
    child = DecodeProcess(port)
    bench = None
    try:
        _store, raw = raw_group(port, rank=0)  # blocks until D joined too
        bench = Bench(shape, max(sizes), child, raw, seed)
        empty_s = bench.empty_transfer_s(max(5, repeat))
        transfers = [bench.measure(tokens, repeat) for tokens in sizes]
        bench.caches = []  # the overlap's engine needs the memory
        overlap = run_overlap(bench.sender, child, bench.tickets, overlap_sizes, repeat, seed) if overlap_sizes else []
        return transfers, empty_s, overlap
    finally:
        if bench is not None:
            bench.close()
        child.stop()


# ----------------------------------------------------------------------- TTFT
def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def time_to_first_token(client, base_url: str, prompt: list[int]) -> tuple[float, str]:
    """(seconds from sending to the first chunk with a choice, x-pdserve-path); drains the rest."""
    body = {"prompt": prompt, "max_tokens": TTFT_MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first = None
    start = time.perf_counter()
    with client.stream("POST", base_url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - start
        path = response.headers.get("x-pdserve-path", "?")
    assert first is not None, "the stream ended without a token"
    return first, path


def counter_sum(cluster, name: str, role: str = "") -> float:
    """Sum of a counter over the workers whose id starts with `role` (prometheus text)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?\{{[^}}]*\}} (\S+)$", re.M)
    return sum(float(v) for wid in cluster.workers if wid.startswith(role)
               for v in pattern.findall(cluster.metrics(wid)))


@dataclass(frozen=True)
class Counters:
    """The cluster's counters that one request moves (read between requests)."""

    transfer_s: float  # prefill workers' KV transfer seconds (P's TransferResult.seconds)
    transfer_bytes: float
    prefix_hits: float  # all workers

    @classmethod
    def read(cls, cluster) -> Counters:
        return cls(counter_sum(cluster, "pdserve_kv_transfer_seconds", "prefill"),
                   counter_sum(cluster, "pdserve_kv_transfer_bytes", "prefill"),
                   counter_sum(cluster, "vllm:prefix_cache_hits"))


@dataclass
class TTFTRun:
    ttft_s: float
    transfer_s: float
    transfer_bytes: float
    prefix_hits: float


@dataclass
class TTFTResult:
    mode: str
    paths: set[str]
    runs: dict[int, list[TTFTRun]]
    """prompt length -> timed runs."""


def run_ttft(mode: str, repeat: int, seed: int, vocab: int) -> TTFTResult:
    import httpx

    from tests.e2e.cluster import start_cluster

    result = TTFTResult(mode, set(), {n: [] for n in TTFT_LENGTHS})
    with tempfile.TemporaryDirectory() as tmp:
        print(f"starting pdserve up ({mode}) ...", flush=True)
        cluster = start_cluster(Path(tmp), *MODES[mode], *CLUSTER_FLAGS)
        try:
            with httpx.Client(timeout=600) as client:
                time_to_first_token(client, cluster.base_url, random_prompt(seed - 1, TTFT_LENGTHS[0], vocab))
                for length, run in itertools.product(TTFT_LENGTHS, range(repeat)):
                    prompt = random_prompt(seed * 1_000_003 + length * 101 + run, length, vocab)
                    before = Counters.read(cluster)
                    ttft, path = time_to_first_token(client, cluster.base_url, prompt)
                    after = Counters.read(cluster)
                    result.paths.add(path)
                    result.runs[length].append(TTFTRun(
                        ttft, after.transfer_s - before.transfer_s,
                        after.transfer_bytes - before.transfer_bytes, after.prefix_hits - before.prefix_hits))
                    print(f"  {mode} {length} tokens run {run + 1}/{repeat}: TTFT {ttft * 1e3:.0f} ms "
                          f"(path {path}; KV transfer {(after.transfer_s - before.transfer_s) * 1e3:.0f} ms)",
                          flush=True)
        finally:
            cluster.stop()
    return result


# -------------------------------------------------------------------- report
TRANSFER_HEADERS = ["prompt tokens", "MB", "raw gloo GB/s", "ours GB/s", "ratio (ours/raw)",
                    f"goal >= {GOAL:.2f}"]
BREAKDOWN_HEADERS = ["prompt tokens", "raw ms", "raw, fresh buffer ms", "ours ms (P: doorbell..ack)",
                     "ours D-side ms", "ours send()->D poll ms", "pack ms (P)",
                     "ours per run GB/s", "raw per run GB/s"]
TTFT_HEADERS = ["prompt tokens", "disaggregated TTFT ms", "colocated TTFT ms",
                "ratio (disagg/coloc)", "of which KV transfer ms (P)", "in-cluster transfer GB/s",
                "disagg per run ms", "coloc per run ms"]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def transfer_rows(results: list[SizeResult]) -> list[list[str]]:
    return [[r.tokens, f"{r.nbytes / 1e6:.1f}", f"{r.raw_gbps:.2f}", f"{r.ours_gbps:.2f}",
             f"{r.ratio:.2f}x", "MET" if r.ratio >= GOAL else "NOT MET"] for r in results]


def breakdown_rows(results: list[SizeResult]) -> list[list[str]]:
    med = statistics.median
    per_run = lambda xs, n: " / ".join(f"{n / s / 1e9:.2f}" for s in xs)  # noqa: E731
    return [[r.tokens, ms(med(r.raw_s)), ms(med(r.raw_fresh_s)), ms(med(o.wire_s for o in r.ours)),
             ms(med(o.d_side_s for o in r.ours)), ms(med(o.to_poll_s for o in r.ours)),
             ms(med(o.pack_s for o in r.ours)), per_run([o.wire_s for o in r.ours], r.nbytes),
             per_run(r.raw_s, r.nbytes)] for r in results]


def ttft_rows(results: dict[str, TTFTResult]) -> list[list[str]]:
    med = statistics.median
    rows = []
    for n in TTFT_LENGTHS:
        dis, col = results["disaggregated"].runs[n], results["colocated"].runs[n]
        dis_s, col_s = med(r.ttft_s for r in dis), med(r.ttft_s for r in col)
        transfer_s = med(r.transfer_s for r in dis)
        gbps = med(r.transfer_bytes for r in dis) / transfer_s / 1e9 if transfer_s else 0.0
        rows.append([n, ms(dis_s), ms(col_s), f"{dis_s / col_s:.2f}x", ms(transfer_s), f"{gbps:.2f}",
                     " / ".join(ms(r.ttft_s) for r in dis), " / ".join(ms(r.ttft_s) for r in col)])
    return rows + [[16384, "not measured", "not measured", "-", "-", "-", "-", "-"]]


def gap_line(r: SizeResult, empty_s: float) -> str:
    """Split ours - raw (medians) into the fixed per-transfer cost and a rest; show what a fresh
    receive buffer costs (D receives into recycled buffers, so it is not part of the gap)."""
    med = statistics.median
    gap = med(o.wire_s for o in r.ours) - med(r.raw_s)
    fresh = med(r.raw_fresh_s) - med(r.raw_s)
    return (f"{r.tokens} tokens: ours - raw = {ms(gap)} ms, of which fixed per-transfer cost "
            f"(0-block transfer) {ms(empty_s)} ms, rest {ms(gap - empty_s)} ms; receiving into a "
            f"fresh buffer instead would cost (raw fresh - raw) {ms(fresh)} ms more")


def notes(shape: KVShape, transfers: list[SizeResult], empty_s: float,
          ttft: dict[str, TTFTResult] | None, args, overlap: list | None = None) -> list[str]:
    lines = [f"goal ours/raw >= {GOAL:.2f} at {r.tokens} tokens: {r.ratio:.2f}x -> "
             f"{'MET' if r.ratio >= GOAL else 'NOT MET'}" for r in transfers]
    lines += [f"overlap at {r.tokens} tokens ({r.chunks} prefill step(s); only the last chunk's layers "
              f"stream): {r.hidden:.0%} of the one-shot transfer's time after the first token is hidden "
              f"behind the prefill's compute" for r in overlap or []]
    lines.append(f"a 0-block transfer through our data plane (doorbell + header + ack, no payload) "
                 f"takes {ms(empty_s)} ms at P (median of {max(5, args.repeat)})")
    lines += [gap_line(r, empty_s) for r in transfers]
    if ttft is None:
        lines.append("TTFT not measured (--skip-ttft)")
    else:
        for t in ttft.values():
            hits = sum(r.prefix_hits for runs in t.runs.values() for r in runs)
            lines.append(f"{t.mode}: x-pdserve-path {'/'.join(sorted(t.paths))}; prefix-cache hits "
                         f"over the timed requests: {hits:.0f} tokens")
        lines.append("TTFT at 16384 tokens is not measured: the model's context (max-model-len) is 8192")
    lines.append(f"KV shape of the default model: {shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
                 f"head_dim {shape.head_dim}, blocks of {shape.block_size}, float32 = "
                 f"{shape.bytes_per_token} bytes/token")
    return lines


def method_lines(args, loads: list[str]) -> list[str]:
    return [
        f"transfer: median of {args.repeat} runs per size after 1 warm-up; D in a spawned child, P in "
        "this process, 127.0.0.1. ours = GlooBackend, P's TransferResult.seconds (doorbell in D's "
        "TCPStore, header, the payload as one frame per layer, trailer, ack; D recycles each payload "
        "after poll() into its receive buffer pool, as a decode worker does after importing the blocks); raw = one plain "
        "ProcessGroupGloo send of a float32 tensor of the same bytes between the same processes, "
        "from P's send() to D's recv().wait() (posted beforehand, buffer touched once and reused); "
        "'raw, fresh buffer' receives into a new torch.empty each time (what our receiver does "
        "without recycled buffers). "
        f"Both ends poll every {POLL_S * 1e3:g} ms. GB/s = 1e9 bytes/s. pack ms is pack_blocks of "
        "scattered block ids on P (into a new tensor), outside the ratio.",
        f"TTFT: pdserve up {' '.join(CLUSTER_FLAGS)}; disaggregated {' '.join(MODES['disaggregated'])}, "
        f"colocated {' '.join(MODES['colocated'])}; one cluster at a time; streaming /v1/completions, "
        f"random token-id prompts of {', '.join(map(str, TTFT_LENGTHS))} tokens (the same ones in both "
        f"modes, fresh each run), max_tokens {TTFT_MAX_TOKENS}, temperature 0, ignore_eos; one warm-up "
        f"request per cluster; median of {args.repeat}. 'of which KV transfer' is the prefill worker's "
        "pdserve_kv_transfer_seconds across the request (its TransferResult.seconds; packing excluded).",
        "load average (1/5/15 min) at start / after transfers / at end: " + " ; ".join(loads)
        + f" on {len(os.sched_getaffinity(0))} usable cores (other jobs on this host make the numbers noisy).",
    ]


def report(shape, transfers, empty_s, ttft, args, loads, overlap=()) -> tuple[str, str]:
    """(terminal text, RESULTS.md body)."""
    note = notes(shape, transfers, empty_s, ttft, args, list(overlap))
    method = method_lines(args, loads)
    tables = [("KV transfer, ours vs raw gloo", TRANSFER_HEADERS, transfer_rows(transfers)),
              ("Where the time goes (medians)", BREAKDOWN_HEADERS, breakdown_rows(transfers))]
    if overlap:
        tables.append(("Transfer hidden behind the prefill (layer by layer vs one-shot, medians)",
                       OVERLAP_HEADERS, overlap_rows(list(overlap))))
    if ttft is not None:
        tables.append(("TTFT, disaggregated vs colocated", TTFT_HEADERS, ttft_rows(ttft)))
    terminal = "\n\n".join(["\n".join(run_header())]
                           + [f"{title}:\n{text_table(h, rows)}" for title, h, rows in tables]
                           + ["\n".join(note), "\n".join(method)])
    markdown = "\n\n".join([f"{title}:\n\n{markdown_table(h, rows)}" for title, h, rows in tables]
                           + ["\n".join(f"- {line}" for line in note),
                              "Method:\n\n" + "\n".join(f"- {line}" for line in method)])
    return terminal, markdown


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,4096,16384", help="prompt sizes in tokens, comma separated")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per size and per TTFT length")
    p.add_argument("--seed", type=int, default=0, help="seed of block ids and prompts")
    p.add_argument("--overlap-sizes", default="1024,4096",
                   help="prompt sizes for the layer-by-layer overlap, comma separated ('' to skip)")
    p.add_argument("--skip-ttft", action="store_true", help="measure only the transfers")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.overlap_sizes = [int(s) for s in args.overlap_sizes.split(",") if s.strip()]
    if not args.sizes or min(args.sizes + [args.repeat]) < 1:
        p.error("--sizes and --repeat must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # SIGTERM unwinds, so the spawned receiver is stopped
    args = parse_args(argv)
    loads = [load_average()]
    print(f"load average (1/5/15 min): {loads[0]}", flush=True)
    shape = default_kv_shape()
    print(f"KV transfers: {shape.bytes_per_token} bytes/token, sizes {args.sizes} ...", flush=True)
    transfers, empty_s, overlap = run_transfers(shape, args.sizes, args.repeat, args.seed, args.overlap_sizes)
    loads.append(load_average())
    ttft = None
    if not args.skip_ttft:
        from engine.loader.locate import default_model_path
        from engine.loader.spec_reader import read_spec

        vocab = read_spec(default_model_path()).vocab_size
        ttft = {mode: run_ttft(mode, args.repeat, args.seed + 1, vocab) for mode in MODES}
    loads.append(load_average())
    terminal, markdown = report(shape, transfers, empty_s, ttft, args, loads, overlap)
    print("\n" + terminal)
    if not args.no_results:
        path = append_results("transfer_bandwidth (gloo, float32)", markdown)
        print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
