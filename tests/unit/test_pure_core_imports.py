"""The pure core imports no torch.cuda, cupy, grpc, redis, ray or httpx (DESIGN.md).

Two checks: importing the pure modules in a fresh interpreter loads none of them, and a
static scan of the pure core's source finds no import of them (engine/scheduler.py may import
torch through engine.sampler, so for it only the static scan applies).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN = ("torch.cuda", "cupy", "grpc", "redis", "ray", "httpx")

PURE_MODULES = (
    "engine.kv_cache",
    "engine.request",
    "engine.scheduler",
    "engine.scheduler_types",
    "engine.sampling_params",
    "engine.capacity",
    "engine.config",
    "engine.registry",
    "router.routing.prefix_index",
    "router.routing.local_prefill",
    "router.ops.planner.model",
)

PURE_FILES = sorted(
    {
        *(REPO / "engine" / "kv_cache").glob("*.py"),
        REPO / "engine" / "scheduler.py",
        REPO / "engine" / "scheduler_types.py",
        REPO / "engine" / "request.py",
        REPO / "engine" / "sampling_params.py",
        REPO / "engine" / "capacity.py",
        REPO / "engine" / "config.py",
        REPO / "engine" / "registry.py",
        REPO / "router" / "routing" / "prefix_index.py",
        REPO / "router" / "routing" / "local_prefill.py",
        REPO / "router" / "ops" / "planner" / "model.py",
    }
)

# Parts of the pure core that other engineers are still writing: checked once they exist.
FUTURE_PURE_PATTERNS = ("router/routing/policy*.py", "router/routing/policy/**/*.py", "kv_transfer/base.py")


def is_forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


def forbidden_imports(path: Path) -> list[str]:
    """`line: module` for each import (or `torch.cuda` attribute use) of a forbidden module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "cuda"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            modules = ["torch.cuda"]
        else:
            continue
        found += [f"{node.lineno}: {m}" for m in modules if is_forbidden(m)]
    return found


def test_importing_the_pure_modules_loads_no_forbidden_module():
    code = (
        "import importlib, json, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"forbidden = {FORBIDDEN!r}\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if any(m == f or m.startswith(f + '.') for f in forbidden))\n"
        "print(json.dumps({'loaded': loaded,\n"
        "                  'llama': 'engine.model.llama' in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    # engine.capacity imports engine.model, whose llama family is registered lazily.
    assert report["llama"] is False


@pytest.mark.parametrize("path", PURE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_pure_core_file_imports_no_forbidden_module(path):
    assert forbidden_imports(path) == []


def test_future_pure_core_files_import_no_forbidden_module():
    paths = sorted({p for pattern in FUTURE_PURE_PATTERNS for p in REPO.glob(pattern)})
    if not paths:
        pytest.skip("router/routing/policy* and kv_transfer/base.py do not exist yet")
    offenders = {str(p.relative_to(REPO)): forbidden_imports(p) for p in paths}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_scan_catches_each_spelling_of_a_forbidden_import(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text(
        "import torch\n"
        "import torch.cuda\n"
        "from torch import cuda\n"
        "from torch.cuda import Stream\n"
        "import cupy as cp\n"
        "from grpc import aio\n"
        "import redis.asyncio\n"
        "import ray\n"
        "import httpx\n"
        "torch.cuda.synchronize()\n"
        "import rayon, grpcio_tools, torch.nn\n"
        "from . import redis\n"
    )
    assert forbidden_imports(source) == [
        "2: torch.cuda",
        "3: torch.cuda",
        "4: torch.cuda",
        "4: torch.cuda.Stream",
        "5: cupy",
        "6: grpc",
        "6: grpc.aio",
        "7: redis.asyncio",
        "8: ray",
        "9: httpx",
        "10: torch.cuda",
    ]
