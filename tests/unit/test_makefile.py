"""`make run ARGS="..."` hands its flags to `pdserve up`; `make help` says so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def make(*argv: str) -> list[str]:
    """The commands make would run (-n: nothing runs, the venv included)."""
    result = subprocess.run(["make", "-n", "-C", str(ROOT), "--no-print-directory", *argv], capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout.splitlines()


def test_make_run_passes_args_to_pdserve_up():
    assert make("run", "ARGS=--port 9000 --decode 2")[-1] == ".venv/bin/pdserve up --port 9000 --decode 2"


def test_make_run_without_args_runs_pdserve_up_with_its_defaults():
    assert make("run")[-1].rstrip() == ".venv/bin/pdserve up"


def test_make_help_documents_args():
    result = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "help"], capture_output=True,
                            text=True, timeout=60, check=True)
    assert 'make run         pdserve up: a whole cluster on this machine; extra flags: make run ARGS="--port 9000"' \
        in result.stdout.splitlines()
