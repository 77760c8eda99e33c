"""Weight-only quantized linears (--quantization): torch's int4/int8 CPU kernels and their
formula, GGUF Q4_0/Q4_1 blocks mapped onto int4 codes, which quantization a load resolves
to, and a model whose linears are quantized end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from engine.config import EngineConfig
from engine.cpu_kernels.int4_matmul import load_int4_kernel
from engine.loader.gguf_loader import read_gguf_spec, read_gguf_weights
from engine.loader.gguf_quant import read_gguf_quantized
from engine.loader.quant_choice import resolve_quantization
from engine.model.quantized_linear import (
    Int4Linear, Int4Weight, Int8Linear, Int8Weight, KernelInt4Int8xLinear, KernelInt4Linear, kernels_available,
    quantize_int4, quantize_int8,
)
from pdserve.specs import engine_argv
from tests.tiny_model import tiny_llm, write_tiny_model
from tests.unit.test_gguf_loader import hf_weights, write_llama_gguf

pytestmark = pytest.mark.skipif(not kernels_available("cpu"), reason="this torch has no int4/int8 CPU kernels")


def test_int4_kernel_computes_q_minus_8_times_scale_plus_zero_per_group_of_32():
    codes = (torch.arange(64) + 5 * torch.arange(3)[:, None]).remainder(16).to(torch.uint8)  # 3 rows: padded to 16
    # Group 0 of every row: scale 1, zero 0; group 1: scale 2, zero -3 (integers: exact in bf16).
    scales = torch.tensor([[1.0, 2.0]] * 3)
    zeros = torch.tensor([[0.0, -3.0]] * 3)
    linear = Int4Linear(Int4Weight(codes, scales, zeros, 32), torch.bfloat16)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[0, 0] = 1  # picks weight column 0: (q - 8) * 1
    x[1, 33] = 1  # picks column 33 (group 1): (q - 8) * 2 - 3
    y = linear(x)
    want_col0 = codes[:, 0].float() - 8
    want_col33 = (codes[:, 33].float() - 8) * 2 - 3
    assert torch.equal(y.float(), torch.stack((want_col0, want_col33)))
    assert want_col0.tolist() == [-8.0, -3.0, 2.0] and want_col33.tolist() == [-17.0, -7.0, 3.0]


def test_int8_kernel_computes_code_times_row_scale():
    codes = torch.zeros(2, 32, dtype=torch.int8)
    codes[:, :4] = torch.tensor([[1, -2, 3, 0], [127, -127, 0, 5]], dtype=torch.int8)
    linear = Int8Linear(Int8Weight(codes, torch.tensor([0.5, 2.0])), torch.bfloat16)
    y = linear(torch.ones(1, 32, dtype=torch.bfloat16))
    assert y.float().tolist() == [[1.0, 10.0]]  # (1 - 2 + 3) * 0.5, (127 - 127 + 5) * 2


def test_an_int8_linear_refuses_widths_its_kernel_gets_wrong():
    with pytest.raises(ValueError, match="int8 linears need in_features divisible by 32, got 8"):
        Int8Linear(Int8Weight(torch.ones(16, 8, dtype=torch.int8), torch.ones(16)), torch.bfloat16)


def test_float32_activations_go_through_the_bfloat16_kernel_and_come_back_float32():
    weight = quantize_int4(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    linear = Int4Linear(weight, torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    y = linear(x)
    assert (linear.compute_dtype, y.dtype, y.shape) == (torch.bfloat16, torch.float32, (5, 64))
    want = x @ weight.dequantize().T
    assert (y - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_quantize_int4_keeps_each_groups_min_and_max():
    w = torch.linspace(-1, 2, 64).reshape(2, 32)
    back = quantize_int4(w).dequantize()
    torch.testing.assert_close(back[:, [0, -1]], w[:, [0, -1]], rtol=0, atol=1e-6)
    half_step = (w.amax(1) - w.amin(1)) / 15 / 2  # one group a row here
    assert bool(((back - w).abs().amax(1) <= half_step + 1e-6).all())


def test_quantize_int8_is_symmetric_per_row():
    w = torch.tensor([[0.5, -1.0, 0.25], [127.0, 1.0, -63.5]])
    q = quantize_int8(w)
    assert q.codes.tolist() == [[64, -127, 32], [127, 1, -64]]
    torch.testing.assert_close(q.scales, torch.tensor([1 / 127, 1.0]))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_gguf_q4_blocks_become_int4_codes_that_dequantize_to_the_gguf_values(tmp_path: Path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(path, hf_weights(), qtype)
    spec = read_gguf_spec(path)
    dense = read_gguf_weights(path, spec)  # the gguf package's dequantizer, Q/K rows un-permuted
    rest, quantized = read_gguf_quantized(path, spec, "gguf")
    assert sorted(rest) == sorted(["model.embed_tokens.weight", "model.norm.weight"] + [
        n for n in dense if "layernorm" in n])
    for name, tensor in rest.items():
        assert torch.equal(tensor, torch.from_numpy(dense[name])), name
    # with int4 linears a Q4 (untied) lm_head is int4 too, its blocks kept like theirs
    assert sorted(quantized) == sorted(n for n in dense if n == "lm_head.weight" or "_proj" in n)
    for name, weight in quantized.items():
        assert isinstance(weight, Int4Weight) and weight.codes.dtype == torch.uint8, name
        # d * q + m as (q - 8) * d + (m + 8d): equal up to float32 rounding of the two forms
        torch.testing.assert_close(weight.dequantize(), torch.from_numpy(dense[name]), rtol=0, atol=2e-6)
    if qtype == QT.Q4_0:
        assert all(float(w.zeros.abs().max()) == 0.0 for w in quantized.values())


def test_gguf_q8_0_linears_are_requantized_to_int8_per_row(tmp_path: Path):
    path = tmp_path / "tiny-q8.gguf"
    write_llama_gguf(path, hf_weights(), QT.Q8_0)
    spec = read_gguf_spec(path)
    dense = read_gguf_weights(path, spec)
    weight = read_gguf_quantized(path, spec, "gguf")[1]["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(weight, Int8Weight)
    ref = torch.from_numpy(dense["model.layers.0.mlp.up_proj.weight"])
    assert (weight.dequantize() - ref).abs().max().item() <= float(weight.scales.max()) / 2 + 1e-6


def test_gguf_keeps_a_q4_gguf_quantized_on_cpu_and_auto_only_with_the_c_kernel_in_bfloat16(tmp_path: Path):
    q4, f32, q8 = tmp_path / "q4.gguf", tmp_path / "f32.gguf", tmp_path / "q8.gguf"
    write_llama_gguf(q4, hf_weights(), QT.Q4_1)
    write_llama_gguf(f32, hf_weights(), QT.F32)
    write_llama_gguf(q8, hf_weights(), QT.Q8_0)
    assert resolve_quantization("gguf", q4, "cpu", True, "bfloat16") == "gguf"
    assert resolve_quantization("auto", q4, "cpu", True, "bfloat16") == "none"  # torch's kernel: dense is faster
    assert resolve_quantization("auto", q4, "cpu", True, "bfloat16", fast_int4=True) == "gguf"  # the C kernel
    assert resolve_quantization("auto", q4, "cpu", True, "float32", fast_int4=True) == "none"  # float32 stays exact
    assert resolve_quantization("auto", q8, "cpu", True, "bfloat16", fast_int4=True) == "none"  # Q8_0: re-quantized
    assert resolve_quantization("auto", q4, "cuda", False, "bfloat16", fast_int4=True) == "none"
    with pytest.raises(ValueError, match="--quantization gguf needs a GGUF file whose linears are Q4_0/Q4_1/Q8_0"):
        resolve_quantization("gguf", f32, "cpu", True, "bfloat16")
    with pytest.raises(ValueError, match="--quantization gguf needs torch's CPU int4/int8 kernels"):
        resolve_quantization("gguf", q4, "cuda", False, "bfloat16")
    assert resolve_quantization("auto", f32, "cpu", True, "bfloat16", fast_int4=True) == "none"
    assert resolve_quantization("auto", tmp_path, "cpu", True, "bfloat16", fast_int4=True) == "none"  # HF folder
    assert resolve_quantization("int8", f32, "cpu", True, "float32") == "int8"
    with pytest.raises(ValueError, match="--quantization int4 needs torch's CPU int4/int8 kernels; "
                                         "device 'cuda' has none here"):
        resolve_quantization("int4", q4, "cuda", False, "bfloat16")


_KERNEL = load_int4_kernel()[0]
_C_BF16 = KernelInt4Linear if _KERNEL is not None and _KERNEL.bf16_supported else Int4Linear
"""What int4 linears are on this host with the C kernel on and bfloat16 activations
(tests/unit/test_cpu_int4_kernel.py)."""
_C_AUTO = KernelInt4Int8xLinear if _KERNEL is not None and _KERNEL.int8x_supported else _C_BF16
"""The same with the default activations (auto: int8 where the kernel has that path)."""


@pytest.mark.parametrize("method, c_kernel, activations, module_type", [
    ("int4", True, "auto", _C_AUTO), ("int4", True, "bfloat16", _C_BF16), ("int4", False, "auto", Int4Linear),
    ("int8", True, "auto", Int8Linear)])
def test_an_hf_folder_is_quantized_at_load_and_generates(tmp_path: Path, method, c_kernel, activations, module_type):
    llm = tiny_llm(write_tiny_model(tmp_path / "tiny"), dtype="bfloat16", quantization=method,
                   cpu_int4_kernel=c_kernel, int4_activations=activations)
    model = llm.engine.runner.model
    linears = {name.rpartition(".")[2]: m for name, m in model.model.layers[1].named_modules()
               if name.endswith("_proj")}
    assert llm.engine.core.quantization == method
    # q|k|v and gate|up fused: 4 linears a layer
    assert sorted(linears) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert all(isinstance(m, module_type) for m in linears.values())
    assert isinstance(model.model.embed_tokens, nn.Embedding)  # embeddings and an HF lm_head stay dense
    assert not isinstance(model.lm_head, (Int4Linear, KernelInt4Linear, KernelInt4Int8xLinear, Int8Linear))
    [out] = llm.generate([[1, 2, 3, 4]], _greedy(6))
    assert len(out.token_ids) == 6


def test_the_lm_head_is_quantized_only_beside_int4_linears_and_from_a_q4_or_q8_0_head():
    from engine.loader.quant_choice import lm_head_quantization

    assert [lm_head_quantization("int4", t) for t in ("Q4_0", "Q4_1", "Q8_0", "F16", None)] == [
        "int4", "int4", "none", "none", "none"]
    # a Q8_0 head keeps its blocks only where the C kernel computes them
    assert [lm_head_quantization("int4", t, q8_kernel=True) for t in ("Q4_1", "Q8_0", "F16", None)] == [
        "int4", "q8_0", "none", "none"]
    assert lm_head_quantization("int8", "Q4_0") == "none"
    assert lm_head_quantization("int8", "Q8_0", q8_kernel=True) == "none"


def test_quantization_is_a_checked_engine_setting_that_specs_pass_on():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8, int4; got 'int3'"):
        EngineConfig(quantization="int3")  # type: ignore[arg-type]
    assert engine_argv(EngineConfig(quantization="int4")) == ["--quantization", "int4"]
    assert engine_argv(EngineConfig()) == []  # auto is the default


def _greedy(n: int):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
