"""Llama family: RMSNorm, RoPE, grouped-query attention, SwiGLU, optionally tied embeddings.

Parameter names follow HF transformers (`model.layers.N.self_attn.q_proj.weight`, ...),
so HF safetensors load as they are and GGUF tensors are renamed once in the loader.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, paged_attention, write_kv
from engine.model.rope import apply_rope
from engine.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as HF does.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False, device=device)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, meta.slot_mapping, k, v)
        o = paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False, device=device)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, device)
        self.mlp = LlamaMLP(spec, device)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, device) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """forward() gives hidden states of every token; compute_logits() the chosen rows' logits."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        """device="meta" builds the shapes without memory (the loader assigns weights)."""
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, device)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, device=device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        cos: torch.Tensor,  # [num_tokens, head_dim], gathered by position
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
