"""Cache of dequantized GGUF weights as safetensors, keyed by the GGUF file's sha256.

Dequantizing a GGUF takes seconds; reading the cached float32 safetensors takes a
fraction of that, so a worker's second start is fast.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


# Bump when the conversion (names, permutation, dtype) changes, so stale caches are not used.
CONVERTER_VERSION = 1


def cache_path(cache_dir: Path, model_file: Path) -> Path:
    return cache_dir / "weights" / f"{file_digest(model_file)[:32]}-v{CONVERTER_VERSION}.safetensors"


def load_cached(path: Path) -> dict[str, torch.Tensor] | None:
    if not path.exists():
        return None
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception:  # a torn or foreign file: ignore it, it will be rewritten
        return None


def store(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Write atomically (temp file + rename) so concurrent workers never read half a file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
    os.replace(tmp, path)
