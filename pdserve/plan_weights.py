"""Where `pdserve plan` puts the weights: quantization, tensor parallelism, CPU offload.

    bytes       engine.capacity.weights_bytes by the quantization a worker would load with
                (--quantization; gguf resolved from the file's header as a worker resolves it).
    --tensor-parallel-size N   (vLLM's meaning) weights split evenly over N GPUs, and the KV
                heads too: each GPU holds num_kv_heads / N of them (one when N > num_kv_heads,
                replicated as vLLM does), so each GPU's KV cache holds every token's share.
    --cpu-offload-gb G         (vLLM's meaning) G GiB of each GPU's weights live in CPU memory,
                streamed in for each forward: "a virtual GPU G GiB larger", paid for in bandwidth.

Pure arithmetic apart from reading the model file's header (no torch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from engine.capacity import format_bytes, weights_bytes
from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from engine.model.spec import ModelSpec

GiB = 1 << 30


class WeightsDoNotFit(ValueError):
    """The weights alone exceed a device's memory: no KV setting can help, the message says what can."""


@dataclass(frozen=True)
class WeightsPlacement:
    quantization: str
    """How the bytes were counted: none, int8 or int4."""
    head: str
    """How the output projection is held: dense, int4 or q8_0 (a GGUF's blocks kept)."""
    quantization_source: str
    """Why, e.g. "--quantization gguf: the GGUF's quantized linears kept (int4)"."""
    total_bytes: int
    """The whole model's weights."""
    tensor_parallel_size: int
    cpu_offload_bytes: int
    """Per GPU (vLLM's --cpu-offload-gb is per GPU)."""
    per_device_bytes: int
    """One device's share that stays in its memory: total / tp - offload, at least 0."""
    kv_heads_per_device: int


def place_weights(
    spec: ModelSpec, dtype: str, quantization: tuple[str, str], tensor_parallel_size: int = 1,
    cpu_offload_gb: float = 0, head: str = "dense",
) -> WeightsPlacement:
    """The placement; raises ValueError when the heads do not split over tensor_parallel_size."""
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if spec.num_heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {spec.num_heads} attention heads")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp} and the model's {spec.num_kv_heads} KV heads: "
                         "one must divide the other")
    if not 0 <= cpu_offload_gb < float("inf"):
        raise ValueError(f"--cpu-offload-gb must be a finite number >= 0, got {cpu_offload_gb}")
    method, source = quantization
    total = weights_bytes(spec, dtype, method, head)
    offload = int(cpu_offload_gb * GiB)
    return WeightsPlacement(
        quantization=method, head=head, quantization_source=source, total_bytes=total, tensor_parallel_size=tp,
        cpu_offload_bytes=offload, per_device_bytes=max(-(-total // tp) - offload, 0),
        kv_heads_per_device=max(spec.num_kv_heads // tp, 1),
    )


def per_device_spec(spec: ModelSpec, placement: WeightsPlacement) -> ModelSpec:
    """The shape one device's KV cache is sized by (its KV heads); the rest is unchanged."""
    return dataclasses.replace(spec, num_kv_heads=placement.kv_heads_per_device,
                               num_heads=spec.num_heads // placement.tensor_parallel_size)


def planned_quantization(config: EngineConfig, path: Path, device_type: str, dtype: str) -> tuple[str, str]:
    """(none|int8|int4, why): a worker's resolution (engine.loader.quant_choice) without torch.
    Plan counts int4/int8 on any device it is asked about (a worker has the kernels on CPU only)."""
    from engine.loader.quant_choice import auto_keeps_q4, bytes_method, resolve_quantization

    if config.quantization in ("int4", "int8", "none"):
        return config.quantization, f"--quantization {config.quantization}"
    if config.quantization == "auto":
        if config.cpu_int4_kernel and auto_keeps_q4(path, device_type, dtype):
            from engine.cpu_kernels.loader import int4_kernel_host

            reason = int4_kernel_host(config.int4_activations)
            if reason is None:
                return "int4", ("--quantization auto: the GGUF's Q4 linears kept (int4), run by the C int4 "
                                "kernel as a worker on this host builds it")
            return "none", f"--quantization auto: dense {dtype}, no C int4 kernel here ({reason})"
        return "none", f"--quantization auto: dense {dtype} (--quantization gguf keeps a GGUF's Q4/Q8 linears)"
    method = resolve_quantization("gguf", path, "cpu", True, dtype)  # raises for a file without Q4/Q8 linears
    counted = bytes_method(method, path)
    return counted, f"--quantization gguf: the GGUF's quantized linears kept ({counted})"


def planned_head(config: EngineConfig, path: Path, device_type: str, dtype: str, method: str, tied: bool) -> str:
    """How a worker would hold the output projection (engine.loader.quant_choice.gguf_head): a
    GGUF's Q8_0 head keeps its blocks beside int4 linears only where the C kernel computes
    (CPU, bfloat16 or float32 (computed in bfloat16), the kernel buildable here), as a worker decides."""
    from engine.cpu_kernels.loader import int4_kernel_host
    from engine.loader.quant_choice import gguf_head

    if method != "int4":
        return "dense"
    q8_kernel = (device_type == "cpu" and dtype != "float16" and config.cpu_int4_kernel
                 and int4_kernel_host(config.int4_activations) is None)
    return gguf_head(path, method, tied, q8_kernel)


def weights_share(config: EngineConfig, device_type: str) -> float:
    """The share of a device's memory weights may take: --gpu-memory-utilization (0.9 on GPU by
    default, vLLM's meaning); on CPU without it, all of MemAvailable (the KV budget is fixed)."""
    if config.gpu_memory_utilization is not None:
        return config.gpu_memory_utilization
    return DEFAULT_GPU_MEMORY_UTILIZATION if device_type == "cuda" else 1.0


def check_weights_fit(placement: WeightsPlacement, device_memory: int, share: float, memory_source: str) -> None:
    """Raise WeightsDoNotFit when one device's weights exceed `share` of its memory, naming the
    numbers and the settings that change them (never the KV cache: it is not the problem)."""
    usable = int(device_memory * share)
    if placement.per_device_bytes <= usable:
        return
    p = placement
    kind = "dense" if p.quantization == "none" else p.quantization
    where = (f"{format_bytes(p.total_bytes)} of {kind} weights"
             + (f" / tensor-parallel-size {p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else "")
             + (f" - {format_bytes(p.cpu_offload_bytes)} --cpu-offload-gb" if p.cpu_offload_bytes else ""))
    raise WeightsDoNotFit(
        f"the weights alone do not fit one device: {where} = {format_bytes(p.per_device_bytes)} per device, "
        f"more than {share:g} x {format_bytes(device_memory)} ({memory_source}) = {format_bytes(usable)}, "
        f"before any KV cache. Raise --tensor-parallel-size, give --cpu-offload-gb at least "
        f"{math.ceil((p.per_device_bytes - usable + p.cpu_offload_bytes) / GiB * 10) / 10:.1f}, or use --quantization int4"
        + (" (already int4)" if p.quantization == "int4" else "") + "."
    )


def weights_rows(w: WeightsPlacement) -> list[tuple[str, str]]:
    """The rows `pdserve plan` prints about the weights (pdserve.plan.render)."""
    rows = [("Quantization:", f"{w.quantization} ({w.quantization_source})")]
    if w.head != "dense":
        rows.append(("Output head:", f"{w.head} (the GGUF's own blocks, beside a dense token embedding when tied)"))
    if w.tensor_parallel_size > 1 or w.cpu_offload_bytes:
        rows += [("Tensor parallel / CPU offload:", f"{w.tensor_parallel_size} device(s), "
                  f"{format_bytes(w.cpu_offload_bytes)} per device offloaded"),
                 ("Weights per device:", format_bytes(w.per_device_bytes)),
                 ("KV heads per device:", str(w.kv_heads_per_device))]
    return rows
