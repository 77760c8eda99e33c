"""GGUF files: model shape from metadata, weights dequantized to float32 by the `gguf` package.

llama.cpp stores Q and K projections with their rows permuted for its interleaved RoPE;
they are permuted back here so the model uses HF's `rotate_half` convention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.model.spec import ModelSpec, RopeScaling

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_gguf_spec(path: Path) -> ModelSpec:
    """The model's shape from GGUF metadata (no tensor data is read)."""
    from engine.loader.gguf_meta import read_gguf_f32_tensor, read_gguf_metadata, read_gguf_tensor_names

    fields = read_gguf_metadata(path)
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (known: llama)")

    def meta(key: str, default=None):
        return fields.get(f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    vocab = meta("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    scaling = RopeScaling()
    if meta("rope.scaling.type") == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(meta("rope.scaling.factor", 1.0)))
    freq_factors = read_gguf_f32_tensor(path, "rope_freqs.weight")
    if freq_factors is not None:  # Llama 3.x: scaling lives in this tensor, not in metadata
        scaling = RopeScaling(rope_type="freq_factors", freq_factors=tuple(freq_factors))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelSpec(
        architecture="llama",
        name=str(fields.get("general.name", path.stem)),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in read_gguf_tensor_names(path),
        rope_scaling=scaling,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of RoPE dimensions (rows of Q or K)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def read_gguf_weights(path: Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name. Raises on unknown tensors."""
    import gguf  # imported here: only a first (uncached) GGUF load needs it

    reader = gguf.GGUFReader(str(path))
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue  # read into ModelSpec.rope_scaling by read_gguf_spec
            raise ValueError(f"{path.name}: unexpected tensor {tensor.name!r}")
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if name.endswith("q_proj.weight"):
            data = _unpermute(data, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            data = _unpermute(data, spec.num_kv_heads)
        weights[name] = np.array(data, dtype=np.float32, order="C", copy=True)  # writable, owned
    return weights
