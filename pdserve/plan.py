"""`pdserve plan`: KV capacity and a prefill:decode ratio for a model and settings, before running.

    capacity   engine.capacity.kv_budget + plan_capacity: the functions a worker calls at start,
               so the "KV cache: ..." line here is the worker's startup log line for the same flags.
    traffic    --mean-input-len/--mean-output-len, or --request-lengths FILE (jsonl or csv).
    P:D ratio  a roofline, every assumption printed: one engine step costs
               max(2 x params x tokens / device FLOP/s, bytes read / device bandwidth).
               prefill: steps of --max-num-batched-tokens prompt tokens, reading the weights once;
               decode: one token for each request of a batch that fills the KV cache (at most
               --max-num-seqs), reading the weights and every request's KV (at its mid-decode length).
               Attention FLOPs and transfer time are left out.

Reads the model's shape only (engine.loader.spec_reader: no weights); torch is imported only to
resolve `auto` device/dtype or to read free device memory, with the worker's own functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from engine.capacity import (
    KVBudget, KVCapacity, format_bytes, kv_budget, kv_dtype_name, plan_capacity,
    resolve_max_model_len,
)
from engine.config import EngineConfig
from engine.model.spec import ModelSpec
from pdserve.engine_args import add_engine_args, engine_config_from_args, parse_bytes
from pdserve.plan_traffic import Traffic, max_model_len_warnings, read_traffic
from pdserve.plan_weights import (
    WeightsPlacement, check_weights_fit, per_device_spec, place_weights, planned_head, planned_quantization,
    weights_rows, weights_share,
)

CPU_FLOPS_PER_CORE = 50e9
"""Quick default, not a measurement: fp32 FMA (AVX2/AVX-512) at about half of peak. This project's
2-core EPYC reached ~80 GFLOP/s per core in batched prefill (benchmarks/RESULTS.md)."""
CPU_BANDWIDTH = 10e9
"""Quick default: one host's DRAM share in bytes/s (the same EPYC: ~13 GB/s at decode batch 1)."""
CUDA_FLOPS = 989e12
"""H100 SXM datasheet, dense bf16 FLOP/s (peak; real steps reach a fraction of it)."""
CUDA_BANDWIDTH = 3.35e12
"""H100 SXM datasheet, HBM3 bytes/s."""


@dataclass(frozen=True)
class DeviceModel:
    """The device plan assumes: memory for the budget, and the two roofline rates."""

    type: str
    """"cpu" or "cuda", resolved as a worker resolves --device."""
    memory_bytes: int
    memory_source: str
    flops: float
    """FLOP/s a step reaches."""
    bandwidth: float
    """Memory bytes/s a step reaches."""
    rates_source: str


@dataclass(frozen=True)
class PDEstimate:
    """Per-worker throughput of each role under the roofline (see the module docstring)."""

    prefill_step_tokens: int
    prefill_step_seconds: float
    prefill_bound: str
    """"compute" or "bandwidth": which term of the roofline won."""
    decode_batch: int
    decode_step_seconds: float
    decode_bound: str
    prefill_requests_per_s: float
    decode_requests_per_s: float

    @property
    def prefill_per_decode(self) -> float:
        """Prefill workers that keep one decode worker busy."""
        return self.decode_requests_per_s / self.prefill_requests_per_s

    @property
    def ratio(self) -> tuple[int, int]:
        """(prefill, decode) as small integers: n:1 or 1:n beyond 4x, else the nearest p:d with d <= 4."""
        r = self.prefill_per_decode
        if r >= 4:
            return round(r), 1
        if r <= 1 / 4:
            return 1, round(1 / r)
        frac = Fraction(r).limit_denominator(4)
        return frac.numerator, frac.denominator


@dataclass(frozen=True)
class Sizing:
    """Worker counts for the given ones (--prefill-workers / --decode-workers)."""

    prefill_workers: int
    decode_workers: int
    requests_per_s: float
    bottleneck: str


@dataclass(frozen=True)
class Plan:
    model_name: str
    model_path: str
    num_params: int
    dtype: str
    weights_bytes: int
    """The whole model's weights, counted by `weights.quantization`."""
    weights: WeightsPlacement
    device: DeviceModel
    budget: KVBudget
    kv_cache_dtype: str
    capacity: KVCapacity
    traffic: Traffic | None
    pd: PDEstimate | None
    sizing: Sizing | None
    warnings: tuple[str, ...]

    def to_json(self) -> dict:
        out = asdict(self)
        cap = self.capacity
        out["capacity"].update(num_tokens=cap.num_tokens, max_concurrency=cap.max_concurrency,
                               total_bytes=cap.total_bytes, log_line=cap.log_line())
        if self.pd is not None:
            out["pd"].update(prefill_per_decode=self.pd.prefill_per_decode, ratio=list(self.pd.ratio))
        if self.traffic is not None:
            del out["traffic"]["lengths"]  # the file's every request; its summary stays
            out["traffic"].update(mean_len=self.traffic.mean_len, needed_len=self.traffic.needed_len)
        return out


@dataclass(frozen=True)
class PlanInputs:
    """What `pdserve plan` takes beyond the engine flags."""

    device_memory: int | None = None
    """Bytes; None: what a worker would see here (free GPU memory, MemAvailable on CPU)."""
    traffic: Traffic | None = None
    prefill_workers: int | None = None
    decode_workers: int | None = None
    device_flops: float | None = None
    device_bandwidth: float | None = None
    tensor_parallel_size: int = 1
    cpu_offload_gb: float = 0


def build_plan(config: EngineConfig, inputs: PlanInputs, spec: ModelSpec, model_path: str) -> Plan:
    """The whole plan. Raises ValueError (with the numbers) for settings a worker would refuse;
    WeightsDoNotFit (a ValueError) when the weights alone exceed a device."""
    device_type, dtype = resolve_device_dtype(config)
    device = device_model(config, device_type, inputs)
    quantization = planned_quantization(config, Path(model_path), device_type, dtype)
    head = planned_head(config, Path(model_path), device_type, dtype, quantization[0], spec.tie_word_embeddings)
    placement = place_weights(spec, dtype, quantization, inputs.tensor_parallel_size, inputs.cpu_offload_gb, head)
    check_weights_fit(placement, device.memory_bytes, weights_share(config, device_type), device.memory_source)
    weights = placement.per_device_bytes
    kv_dtype = kv_dtype_name(config.kv_cache_dtype, dtype)
    budget = kv_budget(config, device_type, weights, lambda: device.memory_bytes)
    capacity = plan_capacity(
        per_device_spec(spec, placement), kv_dtype=kv_dtype, block_size=config.block_size,
        max_model_len=resolve_max_model_len(spec, config.max_model_len),
        kv_budget_bytes=budget.num_bytes, num_blocks_override=config.num_gpu_blocks_override,
    )
    pd = sizing = None
    warnings: list[str] = []
    if weights + capacity.total_bytes > device.memory_bytes:
        warnings.append(
            f"weights ({format_bytes(weights)}) + KV cache ({format_bytes(capacity.total_bytes)}) exceed "
            f"the device memory ({format_bytes(device.memory_bytes)}, {device.memory_source})."
        )
    if inputs.traffic is not None:
        # Each of the tp devices reads its share of the weights and does 1/tp of the FLOPs: one
        # device tp times as fast; offloaded bytes are read too (streamed in each forward).
        tp = placement.tensor_parallel_size
        fast = dataclasses.replace(device, flops=device.flops * tp)
        pd = estimate_pd(spec, weights + placement.cpu_offload_bytes, capacity, inputs.traffic, fast, config)
        sizing = size_workers(pd, inputs.prefill_workers, inputs.decode_workers)
        warnings += max_model_len_warnings(capacity, inputs.traffic, spec.max_position_embeddings)
    return Plan(
        model_name=spec.name, model_path=model_path, num_params=spec.num_params, dtype=dtype,
        weights_bytes=placement.total_bytes, weights=placement, device=device, budget=budget, kv_cache_dtype=kv_dtype,
        capacity=capacity, traffic=inputs.traffic, pd=pd, sizing=sizing, warnings=tuple(warnings),
    )


def resolve_device_dtype(config: EngineConfig) -> tuple[str, str]:
    """(device type, dtype name) by a worker's rules (engine.device); torch only for `auto`."""
    if config.device != "auto" and config.dtype != "auto":
        return config.device, config.dtype
    import torch

    from engine.device import resolve_device, resolve_dtype

    device_type = resolve_device("auto").type if config.device == "auto" else config.device
    return device_type, str(resolve_dtype(config.dtype, torch.device(device_type))).removeprefix("torch.")


def device_model(config: EngineConfig, device_type: str, inputs: PlanInputs) -> DeviceModel:
    if inputs.device_memory is not None:
        memory, memory_source = inputs.device_memory, "--device-memory"
    else:
        memory, memory_source = _local_device_memory(device_type)
    if device_type == "cuda":
        flops, bandwidth, rates = CUDA_FLOPS, CUDA_BANDWIDTH, "cuda default: H100 SXM datasheet (bf16 dense, HBM3)"
    else:
        cores = config.num_threads or len(os.sched_getaffinity(0))
        flops, bandwidth = CPU_FLOPS_PER_CORE * cores, CPU_BANDWIDTH
        rates = f"cpu default: {CPU_FLOPS_PER_CORE / 1e9:g} GFLOP/s per core x {cores} cores, " \
                f"{CPU_BANDWIDTH / 1e9:g} GB/s"
    if inputs.device_flops is not None or inputs.device_bandwidth is not None:
        rates = "given" if None not in (inputs.device_flops, inputs.device_bandwidth) else rates + ", partly given"
    return DeviceModel(
        type=device_type, memory_bytes=memory, memory_source=memory_source,
        flops=inputs.device_flops or flops, bandwidth=inputs.device_bandwidth or bandwidth, rates_source=rates,
    )


def _local_device_memory(device_type: str) -> tuple[int, str]:
    """What a worker on this machine would count as the device's memory before its weights."""
    import torch

    from engine.device import available_memory_bytes

    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda on a machine without CUDA: give --device-memory (e.g. 80GiB)")
    source = "free memory of this GPU" if device_type == "cuda" else "MemAvailable of this machine"
    return available_memory_bytes(torch.device(device_type)), source


def estimate_pd(
    spec: ModelSpec, weights: int, capacity: KVCapacity, traffic: Traffic, device: DeviceModel,
    config: EngineConfig,
) -> PDEstimate:
    flops_per_token = 2 * spec.num_params
    step_tokens = config.step_tokens
    prefill_s, prefill_bound = _roofline(step_tokens * flops_per_token, weights, device)
    request_tokens = min(math.ceil(traffic.mean_len), capacity.max_model_len)
    blocks_per_request = -(-request_tokens // capacity.block_size)
    # A batch of requests at their full length fits the cache; at least one always does.
    batch = max(min(config.max_num_seqs, capacity.num_blocks // blocks_per_request), 1)
    mid_decode_context = traffic.mean_input_len + traffic.mean_output_len / 2
    kv_read = batch * mid_decode_context * capacity.bytes_per_token
    decode_s, decode_bound = _roofline(batch * flops_per_token, weights + kv_read, device)
    return PDEstimate(
        prefill_step_tokens=step_tokens, prefill_step_seconds=prefill_s, prefill_bound=prefill_bound,
        decode_batch=batch, decode_step_seconds=decode_s, decode_bound=decode_bound,
        prefill_requests_per_s=step_tokens / traffic.mean_input_len / prefill_s,
        decode_requests_per_s=batch / (traffic.mean_output_len * decode_s),
    )


def _roofline(flops: float, bytes_read: float, device: DeviceModel) -> tuple[float, str]:
    compute, memory = flops / device.flops, bytes_read / device.bandwidth
    return (compute, "compute") if compute >= memory else (memory, "bandwidth")


def size_workers(pd: PDEstimate, prefill: int | None, decode: int | None) -> Sizing | None:
    """Fill in the missing count (rounded up), or say which side limits the given ones."""
    if prefill is None and decode is None:
        return None
    if decode is None:
        decode = math.ceil(prefill * pd.prefill_requests_per_s / pd.decode_requests_per_s - 1e-9)
    elif prefill is None:
        prefill = math.ceil(decode * pd.decode_requests_per_s / pd.prefill_requests_per_s - 1e-9)
    p_rate, d_rate = prefill * pd.prefill_requests_per_s, decode * pd.decode_requests_per_s
    return Sizing(prefill, decode, min(p_rate, d_rate), "prefill" if p_rate < d_rate else "decode")


# ---------------------------------------------------------------- output
def render(plan: Plan) -> str:
    """The text report, in `vllm bench serve`'s block style."""
    cap, dev = plan.capacity, plan.device
    rows: list[tuple[str, str] | str] = [
        "pdserve plan",
        ("Model:", f"{plan.model_name} ({plan.model_path})"),
        ("Parameters:", f"{plan.num_params:,}"),
        ("Device:", f"{dev.type}, {format_bytes(dev.memory_bytes)} ({dev.memory_source})"),
        (f"Weights memory ({plan.dtype}):", format_bytes(plan.weights_bytes)),
        *weights_rows(plan.weights),
        ("KV budget:", _budget_text(plan.budget)),
        (f"KV bytes per token ({plan.kv_cache_dtype}):", f"{cap.bytes_per_token:,}"),
        ("Blocks x block size:", f"{cap.num_blocks:,} x {cap.block_size}"),
        ("Token capacity:", f"{cap.num_tokens:,}"),
        ("Max model len:", f"{cap.max_model_len:,}"),
        ("Max concurrency:", f"{cap.max_concurrency:.1f}x"),
        ("Worker log line:", cap.log_line()),
    ]
    if plan.traffic is not None and plan.pd is not None:
        rows += _traffic_rows(plan.traffic, cap) + _pd_rows(plan.pd, dev, plan.sizing)
    else:
        rows.append(("P:D ratio:", "give --mean-input-len/--mean-output-len or --request-lengths"))
    lines = []
    for row in rows:
        lines.append(f"{'=' * 14} {row} {'=' * 14}".center(60, "=") if isinstance(row, str)
                     else f"{row[0]:<40}{row[1]}")
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines + ["=" * 60])


def _budget_text(budget: KVBudget) -> str:
    if budget.num_bytes is None:
        return budget.source
    return f"{format_bytes(budget.num_bytes)} ({budget.source})"


def _traffic_rows(traffic: Traffic, cap: KVCapacity) -> list:
    return [
        "Traffic",
        ("Requests:", traffic.source),
        ("Mean input / output tokens:", f"{traffic.mean_input_len:,.1f} / {traffic.mean_output_len:,.1f}"),
        ("Longest request needs:", f"{traffic.needed_len:,} tokens ({traffic.needed_reason})"),
        ("Concurrency at the mean request:", f"{cap.num_tokens / traffic.mean_len:,.1f}x"),
    ]


def _pd_rows(pd: PDEstimate, dev: DeviceModel, sizing: Sizing | None) -> list:
    p, d = pd.ratio
    rows = [
        "Prefill:decode ratio",
        ("Assumed device:", f"{_si(dev.flops)}FLOP/s, {_si(dev.bandwidth)}B/s ({dev.rates_source})"),
        ("Prefill step:", f"{pd.prefill_step_tokens:,} tokens in {pd.prefill_step_seconds * 1e3:,.1f} ms "
                          f"({pd.prefill_bound}-bound)"),
        ("Prefill worker:", f"{_rate(pd.prefill_requests_per_s)} req/s"),
        ("Decode batch (fills the cache):", f"{pd.decode_batch:,} requests"),
        ("Decode step:", f"{pd.decode_step_seconds * 1e3:,.1f} ms ({pd.decode_bound}-bound)"),
        ("Decode worker:", f"{_rate(pd.decode_requests_per_s)} req/s"),
        ("Suggested prefill:decode:", f"{p}:{d} ({pd.prefill_per_decode:.2f} prefill per decode worker)"),
    ]
    if sizing is not None:
        rows.append(("Workers (prefill, decode):", f"{sizing.prefill_workers}, {sizing.decode_workers}: "
                     f"{_rate(sizing.requests_per_s)} req/s, {sizing.bottleneck}-bound"))
    return rows


def _rate(x: float) -> str:
    return f"{x:,.3f}" if x < 10 else f"{x:,.1f}"


def _si(x: float) -> str:
    """1e14 -> '100.0 T' (decimal prefixes, as device datasheets print them)."""
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= size:
            return f"{x / size:,.1f} {prefix}"
    return f"{x:,.1f} "


# ---------------------------------------------------------------- command line
def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (the same as a worker's, so a worker command line plans as is) + plan's own."""
    add_engine_args(parser)
    g = parser.add_argument_group("plan")
    g.add_argument("--device-memory", type=parse_bytes, default=None,
                   help="device memory, e.g. 80GiB (default: what a worker here sees: free GPU memory, "
                        "or MemAvailable on CPU)")
    g.add_argument("--mean-input-len", type=float, default=None, help="mean prompt tokens per request")
    g.add_argument("--mean-output-len", type=float, default=None, help="mean generated tokens per request")
    g.add_argument("--request-lengths", default=None, metavar="FILE",
                   help="measured lengths: jsonl ({\"input_len\": N, \"output_len\": M} or [N, M] a line) "
                        "or csv (input,output a line, optional header)")
    g.add_argument("--prefill-workers", type=int, default=None, help="size the decode side for these")
    g.add_argument("--decode-workers", type=int, default=None, help="size the prefill side for these")
    g.add_argument("--device-flops", type=float, default=None, help="FLOP/s a step reaches, e.g. 4e14")
    g.add_argument("--device-bandwidth", type=float, default=None, help="memory bytes/s, e.g. 3.35e12")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices one worker's weights and KV heads are split over (vLLM's meaning)")
    g.add_argument("--cpu-offload-gb", type=float, default=0,
                   help="GiB of each device's weights kept in CPU memory (vLLM's meaning)")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--live", default=None, metavar="URL",
                   help="ask a running router (e.g. http://127.0.0.1:8000) for its live recommendation instead")


def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the plan; bad input exits with status 2 and the reason (argparse's convention)."""
    if args.live:  # the router's live planner (GET /v1/plan), not this offline estimate
        from pdserve.plan_live import run_live

        return run_live(args.live, args.json)
    from engine.loader.locate import resolve_model_path
    from engine.loader.spec_reader import read_spec

    config = engine_config_from_args(args, parser)
    try:
        inputs = _inputs_from_args(args)
        path = resolve_model_path(config.model)
        plan = build_plan(config, inputs, read_spec(path), str(path))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print(json.dumps(plan.to_json(), indent=2) if args.json else render(plan))
    return 0


def _inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    for name in ("device_memory", "mean_input_len", "mean_output_len", "prefill_workers", "decode_workers",
                 "device_flops", "device_bandwidth"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    traffic = read_traffic(args.mean_input_len, args.mean_output_len, args.request_lengths)
    if traffic is None and (args.prefill_workers or args.decode_workers):
        raise ValueError("--prefill-workers/--decode-workers need --mean-input-len/--mean-output-len "
                         "or --request-lengths")
    return PlanInputs(
        device_memory=args.device_memory, traffic=traffic, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, device_flops=args.device_flops,
        device_bandwidth=args.device_bandwidth, tensor_parallel_size=args.tensor_parallel_size,
        cpu_offload_gb=args.cpu_offload_gb,
    )
