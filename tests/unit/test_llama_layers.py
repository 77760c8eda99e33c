"""The model's cheaper layer forms equal the HF formulas they replace, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import RMSNorm, fuse_weights
from engine.model.quantized_linear import Int4Linear, concat_rows, quantize_int4, quantize_int8


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_rms_norm_equals_hf_llama_rms_norm_bit_for_bit(dtype, rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(576) + 0.5).to(dtype)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), _hf_rms_norm(x, norm.weight, 1e-5))


def test_fuse_weights_stacks_q_k_v_and_gate_up_rows_in_that_order_and_keeps_the_rest():
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    w = {f"model.layers.3.self_attn.{n}.weight": torch.full((2, 4), float(i)) for i, n in enumerate(names)}
    w |= {"model.layers.3.mlp.gate_proj.weight": torch.full((3, 4), 7.0),
          "model.layers.3.mlp.up_proj.weight": torch.full((3, 4), 8.0), "lm_head.weight": torch.zeros(5, 4)}
    fused = fuse_weights(w, torch.cat)
    assert sorted(fused) == ["lm_head.weight", "model.layers.3.mlp.gate_up_proj.weight",
                             "model.layers.3.self_attn.o_proj.weight", "model.layers.3.self_attn.qkv_proj.weight"]
    assert fused["model.layers.3.self_attn.qkv_proj.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert fused["model.layers.3.mlp.gate_up_proj.weight"][:, 0].tolist() == [7, 7, 7, 8, 8, 8]


def test_fused_int4_rows_compute_what_the_separate_linears_compute():
    torch.manual_seed(0)
    parts = [quantize_int4(torch.randn(rows, 64)) for rows in (48, 16, 16)]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    fused = Int4Linear(concat_rows(parts), torch.bfloat16)(x)
    separate = torch.cat([Int4Linear(p, torch.bfloat16)(x) for p in parts], dim=-1)
    assert torch.equal(fused, separate)


def test_concat_rows_refuses_mixed_int4_and_int8():
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match=r"cannot fuse \['Int4Weight', 'Int8Weight'\]: mixed quantization"):
        concat_rows([quantize_int4(w), quantize_int8(w)])
