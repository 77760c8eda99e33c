"""RoPE tables equal HF transformers' LlamaRotaryEmbedding bit for bit, for every scaling type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.model.rope import apply_rope, rope_tables
from engine.model.spec import RopeScaling, rope_scaling_from_dict

CPU = torch.device("cpu")

# (id, head_dim, max positions, HF rope_parameters); transformers 5 takes rope_theta and the
# scaling together in `rope_parameters` (it converts a legacy `rope_scaling` into it).
CASES = [
    ("default-smollm2", 64, 2048, {"rope_type": "default", "rope_theta": 100000.0}),
    ("default-theta10k", 16, 1024, {"rope_type": "default", "rope_theta": 10000.0}),
    ("linear-x4", 64, 4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    (
        "llama3.1",
        128,
        16384,
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    (
        "llama3.2-factor32",
        64,
        16384,
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
]


def _hf_tables(head_dim: int, positions: int, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=positions, rope_parameters=dict(params),
    )
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, positions, head_dim, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(positions)[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("head_dim,positions,params", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rope_tables_equal_hf_llama_rotary_embedding_exactly(head_dim, positions, params):
    scaling = rope_scaling_from_dict(params)
    assert scaling.rope_type == params["rope_type"]
    cos, sin = rope_tables(head_dim, positions, params["rope_theta"], scaling, CPU)
    hf_cos, hf_sin = _hf_tables(head_dim, positions, params)
    assert cos.shape == sin.shape == (positions, head_dim)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, hf_cos), f"cos differs by up to {(cos - hf_cos).abs().max():.2e}"
    assert torch.equal(sin, hf_sin), f"sin differs by up to {(sin - hf_sin).abs().max():.2e}"


def test_llama3_scaling_keeps_high_frequencies_and_slows_the_rest():
    llama3 = rope_scaling_from_dict(CASES[3][3])
    _, sin = rope_tables(128, 2, 500000.0, llama3, CPU)
    _, plain = rope_tables(128, 2, 500000.0, RopeScaling(), CPU)
    # Position 1's angle is the frequency itself. Wavelength 2*pi/f < 8192/4 (i <= 28) is
    # kept; > 8192 (i >= 35) is divided by 8; 29..34 are smoothed in between.
    changed = (sin[1, :64] != plain[1, :64]).nonzero().flatten().tolist()
    assert changed == list(range(29, 64))
    assert torch.allclose(sin[1, 35:64], plain[1, 35:64] / 8, rtol=1e-6, atol=0)  # sin x ~ x here


def test_apply_rope_equals_hf_apply_rotary_pos_emb_exactly():
    torch.manual_seed(0)
    tokens, heads, head_dim = 7, 3, 64
    cos_table, sin_table = rope_tables(head_dim, 32, 10000.0, RopeScaling(), CPU)
    positions = torch.tensor([0, 1, 2, 5, 9, 17, 31])
    q = torch.randn(tokens, heads, head_dim)
    cos, sin = cos_table[positions], sin_table[positions]
    hf_q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))


def test_unknown_rope_type_raises_key_error_listing_known_types():
    with pytest.raises(KeyError, match=r"unknown rope scaling type 'yarn'; known: default, freq_factors, linear, llama3"):
        rope_tables(64, 16, 10000.0, RopeScaling(rope_type="yarn", factor=4.0), CPU)
