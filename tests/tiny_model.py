"""A tiny Llama with random weights, written as an HF folder, for fast lifecycle tests.

It uses the default model's tokenizer (same vocabulary), so text in and text out work;
what it says is noise. It is never a stand-in for the real model in correctness checks
against HF — only for the engine's bookkeeping and batching.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.loader.locate import default_model_path

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _random_hf_state(spec) -> dict[str, torch.Tensor]:
    """HF-named random weights, drawn in the order HF's module tree initialises them (the order
    the engine's model drew them in before it fused projections), so the tiny model keeps its
    weights: embeddings, then per layer q, k, v, o, gate, up, down, then lm_head."""
    from torch import nn

    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    linears = [("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
               ("self_attn.o_proj", h, q), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)]
    state = {"model.embed_tokens.weight": nn.Embedding(spec.vocab_size, h).weight}
    for layer in range(spec.num_layers):
        for name, rows, cols in linears:
            state[f"model.layers.{layer}.{name}.weight"] = nn.Linear(cols, rows, bias=False).weight
        state[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(h)
        state[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(h)
    state["model.norm.weight"] = torch.ones(h)
    state["lm_head.weight"] = nn.Linear(h, spec.vocab_size, bias=False).weight
    return state


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    from engine.loader.hf_loader import read_hf_spec

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    spec = read_hf_spec(folder)
    torch.manual_seed(seed)
    # Larger-than-default projections so the output depends on the context, not just the
    # last token (default init gives a model that repeats its input).
    state = {k: v.detach().clone() * (1.0 if "norm" in k else 4.0) for k, v in _random_hf_state(spec).items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def tiny_llm(folder: Path, **engine_args):
    from engine import LLM

    defaults = dict(dtype="float32", tokenizer=str(default_model_path()), max_model_len=512,
                    num_gpu_blocks_override=256, num_threads=1)
    defaults.update(engine_args)
    return LLM(model=str(folder), **defaults)
