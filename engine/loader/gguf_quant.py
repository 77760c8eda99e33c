"""GGUF linears kept quantized (--quantization; engine/loader/quant_choice.py decides which).

Where each GGUF format lands (ggml's block layouts, 32 weights a block):

    Q4_0  {f16 d; u8 qs[16]}        w = d * (q - 8)   -> int4, scale d, zero 0          exact
    Q4_1  {f16 d, m; u8 qs[16]}     w = d * q + m     -> int4, scale d, zero m + 8d     exact
    Q8_0  {f16 d; i8 qs[32]}        w = d * q         -> int8 per row (torch's int8 kernel has
                                                         no groups): re-quantized, not exact;
                                                         a head beside int4 linears in the C
                                                         kernel: the blocks kept, exact
    other (F16/F32/K-quants)        dequantized by the `gguf` package, then quantized as asked

"Exact" is the codes and the scale/zero formula. The C int4 kernel (engine.cpu_kernels.int4_matmul,
the default on CPUs with AVX512-BF16) keeps d and m as the file's float16 bits; torch's int4
kernel holds scales and zeros in the compute dtype, so there d and m + 8d are rounded to
bfloat16 (8 mantissa bits against f16's 11). In a Q4 nibble byte, qs[j] & 15 is weight j and
qs[j] >> 4 weight j + 16: the C kernel's layout as it is.

Token embeddings stay dense (dequantized): the embedding is a gather. With int4 linears a Q4
head tensor (output.weight, or token_embd.weight when tied) becomes an int4 lm_head with its
blocks kept, and a Q8_0 head (SmolLM2's) keeps its blocks when the C kernel computes the linears
(it reads them at half the bytes of bfloat16); any other head stays dense
(quant_choice.lm_head_quantization).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.loader.gguf_loader import _unpermute, hf_name
from engine.loader.quant_choice import KEPT_GGUF_TYPES, bytes_method, is_linear, lm_head_quantization
from engine.model.quantized_linear import (
    INT4_GROUP_SIZE, Int4Weight, Q8BlockWeight, QuantizedWeight, quantize_int4, quantize_int8,
)
from engine.model.spec import ModelSpec


def read_gguf_quantized(
    path: Path, spec: ModelSpec, method: str, q8_head: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """(dense, quantized): the decoder linears (and with int4 the lm_head) as quantized weights
    under their HF names (rows of q/k un-permuted as the dense loader does), every other tensor
    dequantized to float32. One pass
    and no dense copy of the linears, so a worker's memory holds the quantized bytes only.
    `method` as resolve_quantization returns it; `q8_head`: the C kernel computes the linears, so a
    Q8_0 head may keep its blocks. Raises on unknown tensors."""
    import gguf

    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    head_source = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    scheme = bytes_method(method, path)
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue  # read into ModelSpec.rope_scaling by read_gguf_spec
            raise ValueError(f"{path.name}: unexpected tensor {tensor.name!r}")
        head = lm_head_quantization(scheme, tensor.tensor_type.name, q8_head) if name == head_source else "none"
        if head != "none":
            raw = np.asarray(tensor.data)
            quantized["lm_head.weight"] = (q4_blocks_to_int4(raw, tensor.tensor_type.name) if head == "int4"
                                           else q8_blocks(raw))
            if name == "lm_head.weight":
                continue
        if not is_linear(name):
            dense[name] = _dequantized(tensor)
            continue
        weight = _quantized(tensor, method)
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            weight = _permute_rows(weight, spec.num_heads if "q_proj" in name else spec.num_kv_heads)
        quantized[name] = weight
    return dense, quantized


def _dequantized(tensor) -> torch.Tensor:
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))


def _quantized(tensor, method: str) -> QuantizedWeight:
    kind = tensor.tensor_type.name
    target = KEPT_GGUF_TYPES.get(kind, "none") if method == "gguf" else method
    if kind in ("Q4_0", "Q4_1") and target == "int4":
        return q4_blocks_to_int4(np.asarray(tensor.data), kind)
    dense = _dequantized(tensor)
    if target == "int4":
        return quantize_int4(dense)
    return quantize_int8(dense)  # Q8_0 (auto or int8), or any type asked for int8; "none" never gets here


def q4_blocks_to_int4(raw: np.ndarray, kind: str) -> Int4Weight:
    """GGUF Q4_0/Q4_1 rows ([out, blocks * block_bytes] uint8) -> Int4Weight, codes unchanged."""
    header = 2 if kind == "Q4_0" else 4
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":
        zeros = np.zeros_like(d)  # w = d * (q - 8): exactly the kernel's (q - 8) * scale + 0
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d  # w = d * q + m = (q - 8) * d + (m + 8d)
    qs = blocks[..., header:]
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(rows, -1)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zeros), INT4_GROUP_SIZE)


def q8_blocks(raw: np.ndarray) -> Q8BlockWeight:
    """GGUF Q8_0 rows ([out, blocks * 34] uint8) -> Q8BlockWeight, codes and d bits unchanged."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + INT4_GROUP_SIZE)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return Q8BlockWeight(torch.from_numpy(codes.copy()), torch.from_numpy(d.copy()))


def _permute_rows(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """llama.cpp's RoPE row order back to HF's, on codes and their per-row scales alike."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(_unpermute(t.numpy(), num_heads)))

    if isinstance(weight, Int4Weight):
        return Int4Weight(rows(weight.codes), rows(weight.scales), rows(weight.zeros), weight.group_size)
    return type(weight)(rows(weight.codes), rows(weight.scales))
