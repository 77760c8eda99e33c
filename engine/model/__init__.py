"""Model families. Each registers a class taking a ModelSpec; weights load by HF names, passed
through the class's static `fuse_weights(weights, concat_rows)` first (its fused projections)."""

from engine.model.spec import ModelSpec, RopeScaling
from engine.registry import Registry

MODEL_FAMILIES: Registry[type] = Registry("model family")
MODEL_FAMILIES.register("llama", "engine.model.llama:LlamaForCausalLM")
# HF architecture names map onto the same family.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama"}

__all__ = ["HF_ARCHITECTURES", "MODEL_FAMILIES", "ModelSpec", "RopeScaling"]
