"""Llama family: RMSNorm, RoPE, grouped-query attention, SwiGLU, optionally tied embeddings.

Parameter names follow HF transformers (`model.layers.N.self_attn.q_proj.weight`, ...),
so HF safetensors load as they are and GGUF tensors are renamed once in the loader. Two groups
of projections run as one linear each (FUSED_PROJECTIONS; fuse_weights concatenates their rows
at load): a batch-1 decode step is bound by per-call overhead, not by the matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, paged_attention, write_kv
from engine.model.rope import StepRope
from engine.model.spec import ModelSpec

FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
"""Fused linear -> the HF linears whose weight rows it stacks, in order."""


def fuse_weights(weights: dict, concat_rows) -> dict:
    """`weights` (HF names) with each FUSED_PROJECTIONS group replaced by its fused weight,
    concat_rows([w, ...]) stacking rows (torch.cat for dense weights, quantized_linear.concat_rows
    for codes: each row carries its own scales, so rows concatenate). Other names pass through;
    a group is fused only when all its parts are present."""
    out = dict(weights)
    for name in weights:
        for fused, parts in FUSED_PROJECTIONS.items():
            suffix = f".{parts[0]}.weight"
            if not name.endswith(suffix):
                continue
            prefix = name.removesuffix(suffix)
            names = [f"{prefix}.{part}.weight" for part in parts]
            if all(n in out for n in names):
                out[f"{prefix}.{fused}.weight"] = concat_rows([out.pop(n) for n in names])
    return out


class RMSNorm(nn.Module):
    """forward(x) -> norm(x); forward(x, residual) -> (norm(x + residual), x + residual): the
    residual add a decoder layer makes before each norm, fused in (vLLM's shape), so the C kernel
    does both in one call (it writes x + residual into `residual`)."""

    def __init__(self, size: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps
        self.kernel = None
        """engine.cpu_kernels.rms_norm.RMSNormKernel for bfloat16 rows on the CPU (the engine sets
        it where the library builds); None: torch."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (self.kernel is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()
                and (residual is None or (residual.dtype == torch.bfloat16 and residual.is_contiguous()))):
            if residual is None:
                return self.kernel(x, self.weight, self.eps)
            return self.kernel(x, self.weight, self.eps, residual), residual  # residual += x, in place
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF normalises in float32, rounds to the model dtype, then scales by the weight.
        # torch.rms_norm in float32 equals that bit for bit (tests/unit/test_llama_layers.py)
        # in one op instead of six.
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * torch.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # rows: q, then k, then v (FUSED_PROJECTIONS)
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=False, device=device)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False, device=device)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: StepRope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        if meta.rope_decode is not None and qkv.dtype == torch.bfloat16 and qkv.is_contiguous():
            # a pure decode step on the CPU: rotation, K/V store and attention in one C call
            o = meta.rope_decode(qkv, rope.cos, rope.signed_sin, kv_cache, meta, self.num_heads, self.scale)
            return self.o_proj(o.view(n, self.q_size))
        qk_size = self.q_size + self.kv_size
        # q and k rotated in one pass: [n, num_heads + num_kv_heads, head_dim]
        qk = rope.apply(qkv[:, :qk_size].view(n, -1, self.head_dim))
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, meta.slot_mapping, k, v)
        o = paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        # rows: gate, then up (FUSED_PROJECTIONS)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, device)
        self.mlp = LlamaMLP(spec, device)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)

    def forward(self, x, residual, rope: StepRope, kv_cache, meta):
        """(the MLP's output, the residual stream before it): the next layer's norm adds the two
        (residual None: x is the embedding, the stream's start)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, device) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """forward() gives hidden states of every token; compute_logits() the chosen rows' logits."""

    fuse_weights = staticmethod(fuse_weights)

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
        rope = StepRope.gather(cos, sin, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
