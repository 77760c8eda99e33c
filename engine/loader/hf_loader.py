"""HF folders: config.json + *.safetensors (+ tokenizer.json, read by engine.tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.model import HF_ARCHITECTURES
from engine.model.spec import ModelSpec, rope_scaling_from_dict


def read_hf_spec(folder: Path) -> ModelSpec:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json")
    cfg = json.loads(config_path.read_text())
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        raise ValueError(
            f"{folder.name}: architectures {archs} not supported; known: {sorted(HF_ARCHITECTURES)}"
        )
    num_heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelSpec(
        architecture=family,
        name=str(cfg.get("_name_or_path") or folder.name),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling_from_dict(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def read_hf_weights(folder: Path) -> dict:
    """Tensors by HF name (torch tensors; torch is imported only here)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    weights: dict = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights
