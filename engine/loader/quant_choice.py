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


def resolve_quantization(quantization: str, path: Path, device_type: str, has_kernel: bool, dtype: str) -> str:
    """"none", "int4", "int8", or "gguf" (each linear keeps its GGUF type: auto on a Q4/Q8 GGUF).

    auto keeps a GGUF's quantization when its linears are Q4_x/Q8_0 and the device has a kernel
    for `dtype`: torch's int4/int8 CPU kernels are fast for bfloat16/float16 activations only
    (their float32 path is a reference loop, 50-100x slower), and float32 is what a user picks
    for exact results. Otherwise none. An explicit int4/int8 where no kernel exists raises
    ValueError (float32 then computes those layers in bfloat16)."""
    if quantization in ("int4", "int8"):
        if not has_kernel:
            raise ValueError(f"--quantization {quantization} needs torch's CPU int4/int8 kernels; "
                             f"device {device_type!r} has none here (use --quantization none)")
        return quantization
    if quantization == "none" or not has_kernel or dtype == "float32" or path.is_dir():
        return "none"
    return "gguf" if gguf_linear_types(path) & set(KEPT_GGUF_TYPES) else "none"


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
