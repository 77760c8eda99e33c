"""Loading a model: resolve the path, read its shape, build the module, fill its weights."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.cpu_kernels.int4_matmul import Int4Kernel, load_int4_kernel
from engine.loader import weights_cache
from engine.loader.locate import resolve_model_path
from engine.loader.quant_choice import auto_keeps_q4, is_linear, resolve_quantization
from engine.loader.spec_reader import read_spec
from engine.model import MODEL_FAMILIES
from engine.model.quantized_linear import (
    QuantizedWeight, concat_rows, install_quantized_linears, kernel_computes, kernels_available, quantize_int4,
    quantize_int8,
)
from engine.model.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    module: nn.Module
    spec: ModelSpec
    path: Path
    load_seconds: float
    from_cache: bool
    quantization: str = "none"
    """What --quantization resolved to: none, int4, int8, or gguf (each linear as its GGUF block type)."""


def _gguf_weights(path: Path, spec: ModelSpec, cache_dir: Path | None) -> tuple[dict, bool]:
    from engine.loader.gguf_loader import read_gguf_weights

    cached_file = weights_cache.cache_path(cache_dir, path) if cache_dir else None
    if cached_file is not None:
        weights = weights_cache.load_cached(cached_file)
        if weights is not None:
            return weights, True
    weights = {k: torch.from_numpy(v) for k, v in read_gguf_weights(path, spec).items()}
    if cached_file is not None:
        try:
            weights_cache.store(cached_file, weights)
        except OSError as exc:  # a read-only home must not stop the worker
            logger.warning("could not cache dequantized weights at %s: %s", cached_file, exc)
    return weights, False


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None = None,
    quantization: str = "none",
    cpu_int4_kernel: bool = True,
    int4_activations: str = "auto",
) -> LoadedModel:
    """Build the model on `device` in `dtype` with its weights, the decoder's linears quantized
    as `quantization` (EngineConfig.quantization) resolves here; on CPU, int4 linears run in
    this project's C kernel when `cpu_int4_kernel` and it loads (_int4_kernel), and only then does
    auto keep a Q4 GGUF's blocks (quant_choice.auto_keeps_q4); they take int8 activations when
    `int4_activations` is "int8", or "auto" where the kernel's int8 path runs
    (EngineConfig.int4_activations; on a CPU without AVX512-BF16 it is the only path of the C
    kernel). Raises on missing tensors, and ValueError for int4/int8 on a device without the
    kernels or int8 activations asked for on a CPU with neither AVX512-VNNI nor AVX2."""
    started = time.perf_counter()
    path = resolve_model_path(model)
    spec = read_spec(path)
    dtype_name = str(dtype).removeprefix("torch.")
    wants_kernel = cpu_int4_kernel and device.type == "cpu" and (
        quantization in ("int4", "gguf") or (quantization == "auto" and auto_keeps_q4(path, device.type, dtype_name)))
    kernel, int8_path = _kernel_for(_int4_kernel(), int4_activations) if wants_kernel else (None, False)
    method = resolve_quantization(quantization, path, device.type, kernels_available(device.type), dtype_name,
                                  fast_int4=kernel is not None)
    if method not in ("int4", "gguf"):
        kernel = None
    q8_head = kernel is not None and kernel_computes(dtype)
    int8_activations = _int8_activations(int8_path, int4_activations, kernel, dtype, method)
    weights, quantized, from_cache = _read_weights(path, spec, cache_dir, method, q8_head)
    module = build_module(spec, weights, dtype, device, quantized, kernel, int8_activations)
    del weights, quantized
    _return_freed_memory()
    seconds = time.perf_counter() - started
    logger.info(
        "Loaded %s (%s, %.1fM params, %s, quantization %s) in %.2f s%s",
        spec.name, path.name, spec.num_params / 1e6, str(dtype).removeprefix("torch."),
        method, seconds, " from the weights cache" if from_cache else "",
    )
    return LoadedModel(module, spec, path, seconds, from_cache, method)


def _int8_activations(int8_path: bool, asked: str, kernel: Int4Kernel | None, dtype: torch.dtype,
                      method: str) -> bool:
    """Whether the int4 linears take int8 activations: `_kernel_for` chose that path, and they go
    through the C kernel (else int8 asked for is ignored, and the log says why)."""
    if not (int8_path and kernel is not None and kernel_computes(dtype)):
        if asked == "int8":
            logger.warning("int4 activations int8: ignored, no int4 linears run in the C kernel here "
                           "(quantization %s, %s)", method, str(dtype).removeprefix("torch."))
        return False
    logger.info("int4 linears: int8 activations%s (each row of x quantized per group of 32, as llama.cpp does; "
                "%s build)%s", " (auto)" if asked == "auto" else "", kernel.int8x_build,
                "; --int4-activations bfloat16 keeps the dense model's numerics, at about half the decode speed"
                if asked == "auto" and kernel.bf16_supported else "")
    return True


def _kernel_for(kernel: Int4Kernel | None, asked: str) -> tuple[Int4Kernel | None, bool]:
    """(the kernel when it has a path for `int4_activations` `asked`, whether that path is int8
    activations): int8 when asked for, or auto and the kernel has it. No path: None, with the
    reason logged (int4 linears then use torch's kernel, and auto stays dense). ValueError for
    int8 asked for on a CPU with no int8-activation build: asked for explicitly, so refused."""
    if kernel is None:
        return None, False
    if asked == "int8" or (asked == "auto" and kernel.int8x_supported):
        if not kernel.int8x_supported:
            raise ValueError("--int4-activations int8 needs AVX512-VNNI or AVX2 with FMA and F16C, which this CPU "
                             "(or the kernel's build) lacks")
        return kernel, True
    if not kernel.bf16_supported:
        logger.warning("int4 linears: the C kernel's bfloat16 path needs AVX512-BF16, which this CPU lacks (auto "
                       "stays dense; int4/gguf use torch's kernel)%s",
                       "; --int4-activations int8 runs the C kernel here" if kernel.int8x_supported else "")
        return None, False
    return kernel, False


def _int4_kernel() -> Int4Kernel | None:
    """The C int4 kernel, or None with the reason logged (int4 linears then use torch's kernel,
    and --quantization auto stays dense)."""
    kernel, reason = load_int4_kernel()
    if kernel is None:
        logger.warning("int4 linears: the C kernel is not available (auto stays dense; int4/gguf use torch's "
                       "kernel): %s", reason)
    else:
        logger.info("int4 linears: C kernel %s (bfloat16 path %s, int8-activation path %s)", kernel.path,
                    "yes" if kernel.bf16_supported else "no: needs AVX512-BF16", kernel.int8x_build or "no")
    return kernel


def _return_freed_memory() -> None:
    """Give the load's freed temporaries (float32 dequantized copies) back to the OS. glibc keeps
    freed heap memory for reuse; without this an int4 worker measured 564 MiB RSS after load
    instead of 430 (its weights are 117 MiB against bfloat16's 256). No-op off glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _read_weights(
    path: Path, spec: ModelSpec, cache_dir: Path | None, method: str, q8_head: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight], bool]:
    """(dense weights, quantized decoder linears, read from the weights cache). A GGUF kept
    quantized is read in one pass without the dense cache (engine/loader/gguf_quant.py; a Q8_0
    head keeps its blocks when `q8_head`: the C kernel will compute with them); an HF folder's
    linears are quantized here, popped from its dense weights as they go."""
    if path.is_dir():
        from engine.loader.hf_loader import read_hf_weights

        weights = read_hf_weights(path)
        if method == "none":
            return weights, {}, False
        quantize = quantize_int4 if method == "int4" else quantize_int8
        linears = [name for name in weights if is_linear(name)]
        return weights, {name: quantize(weights.pop(name)) for name in linears}, False
    if method == "none":
        weights, from_cache = _gguf_weights(path, spec, cache_dir)
        return weights, {}, from_cache
    from engine.loader.gguf_quant import read_gguf_quantized

    return (*read_gguf_quantized(path, spec, method, q8_head), False)


def build_module(
    spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    quantized: dict[str, QuantizedWeight] | None = None, int4_kernel: Int4Kernel | None = None,
    int8_activations: bool = False,
) -> nn.Module:
    """The module with dense `weights`, and the linears named in `quantized` as quantized modules
    (int4 ones through `int4_kernel` where given, with int8 activations when asked)."""
    quantized = quantized or {}
    family = MODEL_FAMILIES.get(spec.architecture)
    module = family(spec, device="meta")
    state = family.fuse_weights({k: v.to(device=device, dtype=dtype) for k, v in weights.items()}, torch.cat)
    quantized = family.fuse_weights(quantized, concat_rows)
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(module.state_dict()) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    expected -= set(quantized)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"weights do not fit {spec.name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(state, strict=False, assign=True)
    install_quantized_linears(module, quantized, dtype, int4_kernel, int8_activations)
    if spec.tie_word_embeddings and "lm_head.weight" not in quantized:
        module.lm_head.weight = module.model.embed_tokens.weight
    return module.eval().requires_grad_(False)



