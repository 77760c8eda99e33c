"""A model's shape without its weights and without torch (routers and `pdserve plan` use it)."""

from __future__ import annotations

from pathlib import Path

from engine.model.spec import ModelSpec


def read_spec(path: Path) -> ModelSpec:
    if path.is_dir():
        from engine.loader.hf_loader import read_hf_spec

        return read_hf_spec(path)
    from engine.loader.gguf_loader import read_gguf_spec

    return read_gguf_spec(path)
