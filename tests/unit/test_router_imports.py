"""The router's HTTP side loads neither torch nor the model code, nor grpc (DESIGN.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def loaded_modules_after_import(module: str) -> dict[str, bool]:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "names = ('torch', 'grpc', 'engine.model', 'engine.runner', 'engine.engine')\n"
        "print(json.dumps({n: n in sys.modules for n in names}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_router_http_loads_no_torch_grpc_or_model():
    assert loaded_modules_after_import("router.api.http") == {
        "torch": False,
        "grpc": False,
        "engine.model": False,
        "engine.runner": False,
        "engine.engine": False,
    }


def test_importing_router_grpc_errors_does_not_load_grpc():
    assert loaded_modules_after_import("router.api.grpc_errors")["grpc"] is False
