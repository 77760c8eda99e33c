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


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    from engine.model.llama import LlamaForCausalLM
    from engine.loader.hf_loader import read_hf_spec

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    spec = read_hf_spec(folder)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(spec)
    # Larger-than-default projections so the output depends on the context, not just the
    # last token (default init gives a model that repeats its input).
    state = {k: v.detach().clone() * (1.0 if "norm" in k else 4.0) for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def tiny_llm(folder: Path, **engine_args):
    from engine import LLM

    defaults = dict(dtype="float32", tokenizer=str(default_model_path()), max_model_len=512,
                    num_gpu_blocks_override=256, num_threads=1)
    defaults.update(engine_args)
    return LLM(model=str(folder), **defaults)
