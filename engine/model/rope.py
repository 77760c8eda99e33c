"""Rotary position embeddings (HF `rotate_half` convention) with rope scaling.

cos/sin tables are computed in float32 exactly as HF transformers does
(inv_freq * position in float32, then cos/sin), so logits match it bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model.spec import RopeScaling
from engine.registry import Registry

RopeInvFreq = Registry[object]("rope scaling type")


def _default(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    return inv_freq / scaling.factor


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, smooth in between.
    old_len = scaling.original_max_position_embeddings or 8192
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _freq_factors(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # llama.cpp's rope_freqs tensor: each frequency divided by its factor.
    assert scaling.freq_factors is not None, "freq_factors scaling without factors"
    factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{factors.numel()} rope freq factors for {inv_freq.numel()} frequencies")
    return inv_freq / factors


RopeInvFreq.register("default", _default)
RopeInvFreq.register("freq_factors", _freq_factors)
RopeInvFreq.register("linear", _linear)
RopeInvFreq.register("llama3", _llama3)


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_positions, head_dim] float32."""
    scale_fn = RopeInvFreq.get(scaling.rope_type)
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    inv_freq = scale_fn(inv_freq, scaling)  # type: ignore[operator]
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


@dataclass(frozen=True)
class StepRope:
    """One step's rope factors, gathered by position and cast to the model dtype once per step
    (not once per layer and projection): x * cos + roll(x, half) * signed_sin equals HF's
    x * cos + rotate_half(x) * sin bit for bit, since -a * b == a * -b exactly."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor  # [num_tokens, 1, head_dim]: sin with its first half negated

    @classmethod
    def gather(cls, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> "StepRope":
        """cos/sin: [num_tokens, head_dim] float32 rows of rope_tables."""
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cls(cos.to(dtype)[:, None, :], signed.to(dtype)[:, None, :])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim] (q and k may go through together)."""
        return x * self.cos + x.roll(x.shape[-1] // 2, -1) * self.signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim] (already gathered)."""
    return StepRope.gather(cos, sin, x.dtype).apply(x)
