"""pdserve vs llama.cpp's llama-server: the same GGUF file, the same cores, the same workloads.

    .venv/bin/python benchmarks/vs_llamacpp.py [--quick] [--pdserve-mode colocated|disaggregated]
                                              [--dtype auto|bfloat16|float32] [--no-results]

Method (printed with the results too):

- Servers, one at a time, never both running: llama.cpp's `llama-server` (built by
  benchmarks/peers/build_llamacpp.sh from the source vendored in the llama-cpp-python sdist),
  then `pdserve up`. Both are pinned (taskset) to the same 2 cores and use 2 compute threads.
- Model: the default model's GGUF file (engine.loader.locate), the same file for both. It is
  Q4_1-quantized: llama.cpp computes on the quantized weights; pdserve dequantizes them at
  load to --dtype (auto = bfloat16 on CPUs with avx512_bf16, else float32).
- Concurrency: llama-server `--parallel` = pdserve `--max-num-seqs` (MAX_NUM_SEQS), and
  llama-server `--ctx-size` = slots x CTX_PER_SLOT = pdserve `--max-model-len` per sequence.
- pdserve layout (--pdserve-mode): colocated by default (`pdserve up --colocated`: router,
  Redis and ONE worker with 2 threads), since llama-server is one engine owning both cores;
  the disaggregated layout (1 prefill + 1 decode worker, 1 thread each) is compared with the
  colocated one in benchmarks/disagg_vs_colocated.py. pdserve's router and Redis run on the
  same 2 cores and count as pdserve's cost.
- Load: the same `pdserve bench` command line against each server (only --base-url and the
  result file differ), streaming /v1/completions, temperature 0, eos ignored. Before the timed
  workloads each server gets one untimed warm-up run (other prompts: its own seed).
- Ratios are pdserve / llama.cpp. Throughput: above 1 means pdserve is faster. TTFT and ITL:
  below 1 means pdserve is faster.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks.common import append_results, markdown_table, text_table  # noqa: E402
from benchmarks.peers.servers import (  # noqa: E402
    Processes, Server, build_llama_server, exit_on_sigterm, pinned_cores, run_bench, start_llama_server,
    start_pdserve_up)

MAX_NUM_SEQS = 8
"""pdserve --max-num-seqs and llama-server --parallel."""
CTX_PER_SLOT = 4096
"""Tokens per sequence: pdserve --max-model-len, llama-server --ctx-size / --parallel."""
THREADS = 2
WARMUP_SEED = 1000
BENCH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sizes:
    """Lengths and counts of the three workloads (the mix reuses the short and long lengths)."""

    short_in: int
    short_out: int
    short_count: int
    long_in: int
    long_out: int
    long_count: int
    mixed_count: int
    """Every 4th request of the mix is a long prompt, the others short chats."""
    mixed_rate: float
    """Poisson arrivals of the mix, requests/s."""
    batch1_out: int = 128
    """New tokens of each batch-1 decode request (3 requests, one at a time, 32-token prompts)."""


FULL = Sizes(short_in=128, short_out=128, short_count=32, long_in=2048, long_out=32, long_count=8,
             mixed_count=24, mixed_rate=1.0)
QUICK = Sizes(short_in=64, short_out=16, short_count=4, long_in=1024, long_out=8, long_count=2,
              mixed_count=4, mixed_rate=2.0, batch1_out=16)
LONG_CONCURRENCY = 4
BATCH1 = "decode batch 1"


@dataclass(frozen=True)
class Workload:
    """One `pdserve bench` run; `flags` are the dataset and traffic flags."""

    name: str
    flags: tuple[str, ...]
    description: str


def workloads(z: Sizes, mixed_jsonl: Path) -> list[Workload]:
    """short chats (closed loop at the slot count), long prompts, and a Poisson mix of both."""
    random = ("--dataset-name", "random")
    slots = str(MAX_NUM_SEQS)
    return [
        Workload("short chat", (*random, "--random-input-len", str(z.short_in), "--random-output-len",
                                str(z.short_out), "--num-prompts", str(z.short_count), "--max-concurrency", slots),
                 f"{z.short_count} random prompts of {z.short_in} tokens, {z.short_out} new tokens, "
                 f"at most {slots} in flight"),
        Workload("long prompt", (*random, "--random-input-len", str(z.long_in), "--random-output-len",
                                 str(z.long_out), "--num-prompts", str(z.long_count), "--max-concurrency",
                                 str(LONG_CONCURRENCY)),
                 f"{z.long_count} random prompts of {z.long_in} tokens, {z.long_out} new tokens, "
                 f"at most {LONG_CONCURRENCY} in flight"),
        Workload("mixed", ("--dataset-name", "jsonl", "--dataset-path", str(mixed_jsonl), "--num-prompts",
                           str(z.mixed_count), "--request-rate", str(z.mixed_rate), "--max-concurrency", slots),
                 f"{z.mixed_count} requests from a file, each 4th a long prompt ({z.long_in} tokens in, "
                 f"{z.long_out} out), the others short chats ({z.short_in} in, {z.short_out} out); Poisson "
                 f"arrivals at {z.mixed_rate:g} req/s, at most {slots} in flight"),
        Workload(BATCH1, (*random, "--random-input-len", "32", "--random-output-len", str(z.batch1_out),
                          "--num-prompts", "3", "--max-concurrency", "1"),
                 f"3 random prompts of 32 tokens, {z.batch1_out} new tokens, one at a time: decode tok/s at "
                 "batch 1 = 1000 / mean ITL ms"),
    ]


def write_mixed_jsonl(path: Path, model: Path, z: Sizes) -> None:
    """The mixed workload's prompts, built with pdserve bench's own random dataset (exact token
    lengths; seeds 7 and 8, so no prompt repeats one of the other workloads)."""
    from engine.tokenizer import load_tokenizer
    from pdserve.bench.datasets import random_requests

    tokenizer = load_tokenizer(model)
    short = random_requests(tokenizer, z.mixed_count, z.short_in, z.short_out, seed=7)
    long = random_requests(tokenizer, z.mixed_count // 4, z.long_in, z.long_out, seed=8)
    rows = [long[i // 4] if i % 4 == 3 else short[i] for i in range(z.mixed_count)]
    path.write_text("".join(json.dumps({"prompt": r.prompt, "output_len": r.expected_output_len}) + "\n"
                            for r in rows))


def common_bench_flags(model_name: str) -> tuple[str, ...]:
    return ("--endpoint", "/v1/completions", "--model", model_name, "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm")


def bench_server(procs: Processes, server: Server, model_name: str, loads: list[Workload], out_dir: Path,
                 quick: bool) -> dict[str, dict]:
    """Warm-up run, then every workload in order; workload name -> bench JSON."""
    common = common_bench_flags(model_name)
    warmup = ("--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "8",
              "--num-prompts", "2" if quick else "4", "--seed", str(WARMUP_SEED))
    tag = server.label.replace(".", "").replace(" ", "-")
    run_bench(procs, f"{tag}-warmup", server.base_url, (*common, *warmup), out_dir, BENCH_TIMEOUT_S)
    results = {}
    for load in loads:
        name = f"{tag}-{load.name.replace(' ', '-')}"
        print(f"  {server.label}: {load.name} ...", flush=True)
        results[load.name] = run_bench(procs, name, server.base_url, (*common, *load.flags), out_dir,
                                       BENCH_TIMEOUT_S)
        check_complete(results[load.name], f"{server.label} {load.name}")
    return results


def check_complete(result: dict, what: str) -> None:
    """Every request failing is an error; a few failing is reported (the table's `failed`
    column), since the other requests still measure the server. Requests sent again after a
    dropped keep-alive connection (pdserve.bench.client) are reported too."""
    if result.get("resent"):
        print(f"  NOTE {what}: {result['resent']} request(s) sent again after the server closed a "
              "reused connection before answering", flush=True)
    if not result["failed"]:
        return
    errors = [e for e in result.get("errors", []) if e][:3]
    message = f"{what}: {result['failed']} of {result['num_prompts']} requests failed: {errors}"
    if not result.get("completed"):
        raise RuntimeError(message)
    print(f"  WARNING {message}", flush=True)


def pdserve_flags(mode: str, dtype: str, quantization: str = "auto", int4_activations: str = "auto") -> list[str]:
    layout = ["--colocated", "--decode", "1", "--num-threads", str(THREADS)] if mode == "colocated" else [
        "--prefill", "1", "--decode", "1", "--num-threads", str(THREADS // 2)]
    activations = ["--int4-activations", int4_activations] if int4_activations != "auto" else []
    return [*layout, "--dtype", dtype, "--quantization", quantization, *activations,
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(CTX_PER_SLOT)]


def resolved_activations(asked: str) -> str:
    """What a worker here makes of --int4-activations `asked` (auto: int8 where this CPU runs it)."""
    if asked != "auto":
        return asked
    from engine.cpu_kernels.loader import int4_kernel_host

    return "auto: int8" if int4_kernel_host("int8") is None else "auto: bfloat16"


def our_flags(args: argparse.Namespace) -> list[str]:
    return pdserve_flags(args.pdserve_mode, args.dtype, args.quantization, args.int4_activations)


# ------------------------------------------------------------------ report
METRICS = (  # (column, JSON field, higher is better)
    ("output tok/s", "output_throughput", True),
    ("total tok/s", "total_token_throughput", True),
    ("mean TTFT ms", "mean_ttft_ms", False),
    ("p99 TTFT ms", "p99_ttft_ms", False),
    ("mean ITL ms", "mean_itl_ms", False),
    ("p99 ITL ms", "p99_itl_ms", False),
)


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def tables(ours: dict[str, dict], peer: dict[str, dict]) -> tuple[list[str], list[list[object]], list[list[object]]]:
    """(headers, per-server rows, ratio rows)."""
    headers = ["workload", "server", *(m[0] for m in METRICS), "failed"]
    rows, ratios = [], []
    for load in ours:
        for label, result in (("pdserve", ours[load]), ("llama.cpp", peer[load])):
            rows.append([load, label, *(f"{result[field]:.1f}" for _, field, _ in METRICS), result["failed"]])
        ratios.append([load, "pdserve/llama.cpp",
                       *(ratio(ours[load][field], peer[load][field]) for _, field, _ in METRICS), ""])
    return headers, rows, ratios


def verdicts(ours: dict[str, dict], peer: dict[str, dict]) -> list[str]:
    """One plain sentence per workload: who is faster, by how much."""
    lines = []
    for load in ours:
        parts = []
        for column, field, higher_better in (m for m in METRICS if m[1] != "total_token_throughput"):
            r = ours[load][field] / peer[load][field] if peer[load][field] else float("nan")
            better = r > 1 if higher_better else r < 1
            parts.append(f"{column} {r:.2f}x ({'pdserve better' if better else 'llama.cpp better'})")
        lines.append(f"- {load}: " + ", ".join(parts))
    if BATCH1 in ours:
        mine, theirs = (1000 / r[BATCH1]["mean_itl_ms"] for r in (ours, peer))
        lines.append(f"- decode tok/s at batch 1 (1000 / mean ITL): pdserve {mine:.1f}, llama.cpp {theirs:.1f}, "
                     f"ratio {mine / theirs:.2f}x (goal >= 1.0x)")
    return lines


def method_lines(args: argparse.Namespace, model: Path, binary: Path, cores: str, loads: list[Workload],
                 resolved_dtype: str) -> list[str]:
    return [
        f"- model: {model.name} (the same file for both; Q4_1: llama.cpp computes on the quantized weights; "
        f"pdserve --quantization {args.quantization} (gguf, and auto in bfloat16 where the C int4 kernel loads: "
        f"keeps the Q4_1 blocks; none: dequantized at load), activations {resolved_dtype}, int4 linears' "
        f"activations {resolved_activations(args.int4_activations)} (int8: quantized per group of 32 as llama.cpp "
        f"does)",
        f"- llama.cpp: {binary} (llama-cpp-python {binary.parent.parent.name.split('-')[-1]}'s vendored "
        f"source; CPU, GGML_NATIVE=ON, OpenMP), `--parallel {MAX_NUM_SEQS} --ctx-size "
        f"{MAX_NUM_SEQS * CTX_PER_SLOT} --threads {THREADS} --threads-batch {THREADS}`, other settings default",
        f"- pdserve: `pdserve up {' '.join(our_flags(args))}` "
        f"({args.pdserve_mode}; router and Redis on the same cores)",
        f"- both pinned with `taskset -c {cores}`, one server at a time",
        "- load: `pdserve bench " + " ".join(common_bench_flags("SmolLM2-135M-Instruct"))
        + " --base-url URL <workload flags>`; one untimed warm-up run per server",
        *(f"- workload {w.name}: {w.description}: `{' '.join(w.flags)}`" for w in loads),
        "- ratios are pdserve / llama.cpp: throughput > 1 and TTFT/ITL < 1 mean pdserve is faster",
    ]


def resolved_dtype_name(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    from engine.device import cpu_has_avx512_bf16

    return "bfloat16 (auto: this CPU has avx512_bf16)" if cpu_has_avx512_bf16() else "float32 (auto)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run; nothing is appended to RESULTS.md")
    parser.add_argument("--pdserve-mode", choices=("colocated", "disaggregated"), default="colocated")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="pdserve's dtype")
    parser.add_argument("--quantization", choices=("auto", "none", "gguf", "int8", "int4"), default="auto",
                        help="pdserve's --quantization (gguf keeps the GGUF's Q4_1 blocks as int4; auto: dense)")
    parser.add_argument("--int4-activations", choices=("auto", "bfloat16", "int8"), default="auto",
                        help="pdserve's --int4-activations (int8: llama.cpp's numerics, integer dot products; auto, "
                             "the default: int8 where the CPU runs it)")
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    exit_on_sigterm()

    from engine.loader.locate import DEFAULT_MODEL_NAME, default_model_path

    model = default_model_path()
    binary = build_llama_server()
    cores = ",".join(map(str, pinned_cores(THREADS)))
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-vs-llamacpp-"))
    print(f"work dir (logs, bench JSON): {workdir}", flush=True)
    mixed = workdir / "mixed.jsonl"
    sizes = QUICK if args.quick else FULL
    write_mixed_jsonl(mixed, model, sizes)
    loads = workloads(sizes, mixed)
    with Processes(workdir) as procs:
        server = start_llama_server(procs, binary, model, alias=DEFAULT_MODEL_NAME, parallel=MAX_NUM_SEQS,
                                    ctx_per_slot=CTX_PER_SLOT, threads=THREADS, cores=cores)
        peer = bench_server(procs, server, DEFAULT_MODEL_NAME, loads, workdir, args.quick)
        procs.stop(server.proc)
        server = start_pdserve_up(procs, "pdserve", our_flags(args), cores)
        ours = bench_server(procs, server, DEFAULT_MODEL_NAME, loads, workdir, args.quick)
        procs.stop(server.proc, sig=signal.SIGINT)  # pdserve up's Ctrl-C path stops its children

    headers, rows, ratios = tables(ours, peer)
    method = method_lines(args, model, binary, cores, loads, resolved_dtype_name(args.dtype))
    print("\n" + text_table(headers, rows + ratios) + "\n")
    print("\n".join(verdicts(ours, peer)) + "\n\nMethod:\n" + "\n".join(method))
    if args.quick or args.no_results:
        print("\n(quick/no-results run: RESULTS.md left alone)")
        return 0
    importlib.import_module("torch")  # only so that the results header lists its version

    body = "\n".join([markdown_table(headers, rows + ratios), "", *verdicts(ours, peer), "", "Method:", "",
                      *method])
    path = append_results(f"vs_llamacpp (pdserve {args.pdserve_mode}, {args.dtype}, "
                          f"--quantization {args.quantization}, --int4-activations {args.int4_activations})", body)
    print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
