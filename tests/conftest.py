"""Shared test settings: a per-run weights cache, a cluster secret, and the gpu marker's skip."""

from __future__ import annotations

import os
import secrets
import tempfile

import pytest

# Tests share one dequantized-weights cache per machine, outside the repo and ~.
os.environ.setdefault("PDSERVE_CACHE_DIR", os.path.join(tempfile.gettempdir(), "pdserve-test-cache"))
# Workers and routers refuse to start without the cluster secret; tests' children inherit this
# one, in-process code reads it with proto.auth.load_cluster_secret() (fresh per run).
os.environ.setdefault("PDSERVE_CLUSTER_SECRET", secrets.token_urlsafe(32))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
