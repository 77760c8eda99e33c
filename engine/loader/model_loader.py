"""Loading a model: resolve the path, read its shape, build the module, fill its weights."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.loader import weights_cache
from engine.loader.locate import resolve_model_path
from engine.loader.spec_reader import read_spec
from engine.model import MODEL_FAMILIES
from engine.model.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    module: nn.Module
    spec: ModelSpec
    path: Path
    load_seconds: float
    from_cache: bool


def _gguf_weights(path: Path, spec: ModelSpec, cache_dir: Path | None) -> tuple[dict, bool]:
    from engine.loader.gguf_loader import read_gguf_weights

    cached_file = weights_cache.cache_path(cache_dir, path) if cache_dir else None
    if cached_file is not None:
        weights = weights_cache.load_cached(cached_file)
        if weights is not None:
            return weights, True
    weights = {k: torch.from_numpy(v) for k, v in read_gguf_weights(path, spec).items()}
    if cached_file is not None:
        try:
            weights_cache.store(cached_file, weights)
        except OSError as exc:  # a read-only home must not stop the worker
            logger.warning("could not cache dequantized weights at %s: %s", cached_file, exc)
    return weights, False


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Build the model on `device` in `dtype` with its weights. Raises on missing tensors."""
    started = time.perf_counter()
    path = resolve_model_path(model)
    spec = read_spec(path)
    if path.is_dir():
        from engine.loader.hf_loader import read_hf_weights

        weights, from_cache = read_hf_weights(path), False
    else:
        weights, from_cache = _gguf_weights(path, spec, cache_dir)
    module = build_module(spec, weights, dtype, device)
    seconds = time.perf_counter() - started
    logger.info(
        "Loaded %s (%s, %.1fM params, %s) in %.2f s%s",
        spec.name, path.name, spec.num_params / 1e6, str(dtype).removeprefix("torch."),
        seconds, " from the weights cache" if from_cache else "",
    )
    return LoadedModel(module, spec, path, seconds, from_cache)


def build_module(
    spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> nn.Module:
    family = MODEL_FAMILIES.get(spec.architecture)
    module = family(spec, device="meta")
    state = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(module.state_dict()) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"weights do not fit {spec.name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(state, strict=False, assign=True)
    if spec.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    return module.eval().requires_grad_(False)



