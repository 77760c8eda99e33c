"""Which quantization a load uses (--quantization), decided from the file's header alone.

Torch-free, so `pdserve plan` and a worker decide alike; the worker passes whether its device
has the kernels (engine.model.quantized_linear.kernels_available), plan assumes CPU has them.
"""

from __future__ import annotations

from pathlib import Path

KEPT_GGUF_TYPES = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}
"""GGUF types whose blocks map onto a quantized linear (engine/loader/gguf_quant.py's table)."""


def is_linear(name: str) -> bool:
    """HF names of the decoder layers' linears (not embeddings, norms or lm_head)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def auto_keeps_q4(path: Path, device_type: str, dtype: str) -> bool:
    """Whether --quantization auto keeps this file's linears as int4 blocks when the C int4 kernel
    runs them (engine.cpu_kernels.int4_matmul): on CPU in bfloat16, a GGUF whose decoder linears
    are all Q4_0/Q4_1. That kernel reads a quarter of the bytes and computes as llama.cpp does
    (int8 activations, EngineConfig.int4_activations auto; benchmarks/RESULTS.md: batch-1 decode
    about twice llama.cpp's speed on the same file), or with --int4-activations bfloat16 with
    bfloat16(q * d + m), the very values the dense bfloat16 load holds (short chats at batch 8
    about 1.2x faster than dense). float32 stays dense, so stays exact against HF."""
    if device_type != "cpu" or dtype != "bfloat16" or path.is_dir():
        return False
    types = gguf_linear_types(path)
    return bool(types) and types <= {"Q4_0", "Q4_1"}


def resolve_quantization(quantization: str, path: Path, device_type: str, has_kernel: bool, dtype: str,
                         fast_int4: bool = False) -> str:
    """"none", "int4", "int8", or "gguf" (each linear keeps its GGUF type, Q4_x/Q8_0).

    auto is gguf where auto_keeps_q4 and `fast_int4` (the C int4 kernel is loaded), else dense
    (none): served through pdserve on this project's 2-core CPU, torch's own int4 kernel beat
    oneDNN-packed bfloat16 only at batch 1 and lost on long and mixed traffic (benchmarks/RESULTS.md,
    vs_llamacpp 2026-11-24: long prompts 0.92x llama.cpp with it, 1.35x dense). Its float32 path is
    a reference loop, 50-100x slower, so gguf and int4/int8 compute in bfloat16. gguf, int4 or int8
    where no kernel exists, or gguf on a file without Q4/Q8 linears, raises ValueError."""
    if quantization == "gguf":
        if not has_kernel:
            raise ValueError(f"--quantization gguf needs torch's CPU int4/int8 kernels; device {device_type!r} "
                             "has none here (use --quantization none)")
        if path.is_dir() or not gguf_linear_types(path) & set(KEPT_GGUF_TYPES):
            raise ValueError(f"--quantization gguf needs a GGUF file whose linears are "
                             f"{'/'.join(KEPT_GGUF_TYPES)}; {path} has none")
        return "gguf"
    if quantization in ("int4", "int8"):
        if not has_kernel:
            raise ValueError(f"--quantization {quantization} needs torch's CPU int4/int8 kernels; "
                             f"device {device_type!r} has none here (use --quantization none)")
        return quantization
    if quantization == "auto" and fast_int4 and auto_keeps_q4(path, device_type, dtype):
        return "gguf"
    return "none"


def lm_head_quantization(linear_scheme: str, head_type: str | None, q8_kernel: bool = False) -> str:
    """How the output projection is held ("int4", "q8_0" or "none"): int4 only beside int4 linears
    and when the file's head tensor (output.weight, or token_embd.weight when tied; `head_type` its
    GGUF type, None for an HF folder) is Q4_0/Q4_1, whose blocks it keeps exactly, as llama.cpp
    computes with the file's own type; q8_0 beside int4 linears when the head is Q8_0 and the C
    kernel computes (`q8_kernel`): its blocks kept, each weight the value the dense head would
    hold, at half the bytes a token (SmolLM2's 49152 x 576 head at 1 thread: ~2 ms against ~4.5
    for the packed bfloat16 head). Speed would say int4 everywhere (49152x576 at 1 thread:
    int4 1.6 ms, oneDNN-packed bfloat16 3.5 ms, torch's int8 kernel 3.8 ms), but re-quantizing
    SmolLM2's Q8_0 head to int4 moved the first token off llama.cpp's top-1 on 3 of 30 prompts
    and halved greedy agreement (tests/lifecycle/test_quantized_matches_llamacpp.py), so any
    other head stays dense, as does a tied embedding (a gather, not a matmul)."""
    if linear_scheme != "int4":
        return "none"
    if head_type in ("Q4_0", "Q4_1"):
        return "int4"
    return "q8_0" if head_type == "Q8_0" and q8_kernel else "none"


def gguf_head(path: Path, linear_scheme: str, tied: bool, q8_kernel: bool) -> str:
    """How a worker holds a model's output projection ("dense", "int4" or "q8_0"; capacity.HEADS):
    lm_head_quantization on the file's head tensor (token_embd.weight when tied); an HF folder's
    head is dense."""
    if path.is_dir():
        return "dense"
    from engine.loader.gguf_meta import read_gguf_tensor_types

    head_type = read_gguf_tensor_types(path).get("token_embd.weight" if tied else "output.weight")
    held = lm_head_quantization(linear_scheme, head_type, q8_kernel)
    return "dense" if held == "none" else held


def gguf_linear_types(path: Path) -> set[str]:
    """The ggml types of a GGUF's decoder linears, e.g. {"Q4_1"}."""
    from engine.loader.gguf_loader import hf_name
    from engine.loader.gguf_meta import read_gguf_tensor_types

    return {kind for name, kind in read_gguf_tensor_types(path).items() if is_linear(hf_name(name) or "")}


def bytes_method(method: str, path: Path) -> str:
    """The one scheme weight bytes are counted by: "gguf" counts as int4 when any linear is Q4
    (Q4 and Q8 mixed in one file is rare; plan says which it assumed)."""
    if method != "gguf":
        return method
    return "int4" if gguf_linear_types(path) & {"Q4_0", "Q4_1"} else "int8"
