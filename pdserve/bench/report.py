"""The printed result block and the result JSON, with vLLM's labels and field names.

The JSON holds vLLM's fields (run settings, totals, throughputs, mean/median/std and the
percentiles of each latency metric in ms, and the per-request arrays ttfts, itls, latencies,
input_lens, output_lens, start_times, generated_texts, errors), and pdserve's own
`client_cpu_percent` / `client_cpu_seconds`. Unlike vLLM, every latency metric is always
written with its median, p90 and p99, whatever --percentile-metrics prints.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.metrics import METRICS, BenchmarkMetrics, percentile_word
from pdserve.bench.runner import RunResult

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
FAILURES_SHOWN = 5


@dataclass(frozen=True)
class RunInfo:
    """What the run was, for the JSON and the header lines."""

    backend: str
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    label: str | None = None


def _line(label: str, value: object, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def result_block(m: BenchmarkMetrics, run: RunResult, info: RunInfo, printed_metrics: Sequence[str],
                 printed_percentiles: Sequence[float], goodput: bool) -> str:
    """vLLM's "Serving Benchmark Result" block, plus the client's CPU use."""
    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             _line("Successful requests:", m.completed), _line("Failed requests:", m.failed)]
    resent = sum(o.resent for o in run.outputs)
    if resent:  # connections the server closed before answering (see pdserve.bench.client)
        lines.append(_line("Resent after a dropped connection:", resent))
    if info.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", info.max_concurrency))
    if not math.isinf(info.request_rate):
        lines.append(_line("Request rate configured (RPS):", info.request_rate, ".2f"))
    lines += [_line("Benchmark duration (s):", run.duration_s, ".2f"),
              _line("Total input tokens:", m.total_input), _line("Total generated tokens:", m.total_output),
              _line("Request throughput (req/s):", m.request_throughput, ".2f")]
    if goodput:
        lines.append(_line("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [_line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              _line("Peak concurrent requests:", float(m.max_concurrent_requests), ".2f"),
              _line("Total token throughput (tok/s):", m.total_token_throughput, ".2f"),
              _line("Client CPU use (% of one core):", run.cpu_percent, ".1f")]
    for name in (n for n in METRICS if n in printed_metrics):
        short, header = HEADERS[name]
        s = m.stats[name]
        lines += ["{:-^50}".format(header), _line(f"Mean {short} (ms):", s.mean, ".2f"),
                  _line(f"Median {short} (ms):", s.median, ".2f")]
        lines += [_line(f"P{percentile_word(p)} {short} (ms):", v, ".2f")
                  for p, v in s.percentiles if p in printed_percentiles]
    lines += _delivery_lines(m)
    lines.append("=" * 50)
    return "\n".join(lines)


def _delivery_lines(m: BenchmarkMetrics) -> list[str]:
    """Token delivery delay, only when the server sent each token's sample time (pdserve)."""
    s = m.delivery
    if s is None:
        return []
    p99 = dict(s.percentiles).get(99.0, 0.0)
    return ["{:-^50}".format("Token Delivery Delay (sample -> client)"),
            _line("Mean delivery (ms):", s.mean, ".2f"), _line("Median delivery (ms):", s.median, ".2f"),
            _line("P99 delivery (ms):", p99, ".2f")]


def failure_lines(run: RunResult) -> list[str]:
    """The failure count and the first few messages (empty when none failed)."""
    failed = [o for o in run.outputs if not o.success]
    if not failed:
        return []
    lines = [f"{len(failed)} of {len(run.outputs)} requests failed; the first {min(len(failed), FAILURES_SHOWN)}:"]
    lines += [f"  error {i}: {o.error}" for i, o in enumerate(failed[:FAILURES_SHOWN])]
    return lines


def result_json(m: BenchmarkMetrics, run: RunResult, info: RunInfo, goodput: bool) -> dict:
    outputs = run.outputs
    result = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.backend, "backend": info.backend, "label": info.label,
        "model_id": info.model_id, "tokenizer_id": info.tokenizer_id, "num_prompts": info.num_prompts,
        "request_rate": info.request_rate if not math.isinf(info.request_rate) else "inf",
        "burstiness": info.burstiness, "max_concurrency": info.max_concurrency,
        "duration": run.duration_s, "completed": m.completed, "failed": m.failed,
        "resent": sum(o.resent for o in outputs),
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if goodput else None,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": list(m.output_lens),
        "ttfts": [o.ttft for o in outputs], "itls": [list(o.itl) for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "client_cpu_percent": run.cpu_percent, "client_cpu_seconds": run.cpu_s,
    }
    if any(o.delivery for o in outputs):  # pdserve's per-token sample times: which tokens were late
        result["deliveries"] = [list(o.delivery) for o in outputs]
    stats = dict(m.stats) | ({"delivery": m.delivery} if m.delivery is not None else {})
    for name, s in stats.items():
        result[f"mean_{name}_ms"], result[f"median_{name}_ms"], result[f"std_{name}_ms"] = s.mean, s.median, s.std
        for p, value in s.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result


def result_path(info: RunInfo, result_dir: str | None, result_filename: str | None, date: str) -> Path:
    """vLLM's default name: {label}-{rate}qps[-concurrency{c}]-{model}-{date}.json."""
    name = result_filename
    if name is None:
        concurrency = f"-concurrency{info.max_concurrency}" if info.max_concurrency is not None else ""
        model = info.model_id.rstrip("/").split("/")[-1]
        name = f"{info.label or info.backend}-{info.request_rate}qps{concurrency}-{model}-{date}.json"
    return Path(result_dir or ".") / name


def save_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return path
