"""A KV cache that cannot hold one max_model_len request is a setting, not a crash: a worker
(`pdserve decode`), `pdserve generate` and `pdserve up` each print the message once, with no
traceback — refused before the model loads when the budget is fixed (pdserve.preflight), and
by the engine itself when it is a share of the memory free at start.

Real processes through the real CLI, on the tiny random-weight model (tests/tiny_model.py):
the model loads in about a second, and what is tested is what the user reads."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loader.locate import default_model_path
from pdserve.ports import free_ports
from proto.auth import CLUSTER_SECRET_ENV
from tests.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MESSAGE_END = ("cannot hold one request of max_model_len=1,024 tokens, which needs 64 blocks (0.5 MiB). "
               "Raise --kv-cache-memory / --gpu-memory-utilization / --num-gpu-blocks-override, "
               "or lower --max-model-len to at most 64.")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def run_pdserve(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, CLUSTER_SECRET_ENV: secrets.token_hex(32)}
    return subprocess.run([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


def tiny_engine_flags(model: Path) -> list[str]:
    return ["--model", str(model), "--tokenizer", str(default_model_path()), "--dtype", "float32",
            "--num-threads", "1", "--max-model-len", "1024"]


def message_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "KV cache too small" in line]


def test_a_decode_worker_that_cannot_fit_one_request_says_so_once_without_a_traceback(tiny_model_dir):
    result = run_pdserve("decode", *tiny_engine_flags(tiny_model_dir), "--num-gpu-blocks-override", "4")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = message_lines(result.stderr)
    assert line == "pdserve decode: KV cache too small: 4 blocks x 16 = 64 tokens (512 B/token) " + MESSAGE_END


def test_generate_that_cannot_fit_one_request_says_so_once_without_a_traceback(tiny_model_dir):
    result = run_pdserve("generate", "hi", *tiny_engine_flags(tiny_model_dir), "--num-gpu-blocks-override", "4")
    assert (result.returncode, result.stdout) == (2, "")
    assert "Traceback" not in result.stderr
    [line] = message_lines(result.stderr)
    assert line.startswith("pdserve generate: KV cache too small: 4 blocks x 16 = 64 tokens")


def test_generate_whose_share_of_free_memory_cannot_fit_one_request_says_so_once(tiny_model_dir):
    result = run_pdserve("generate", "hi", *tiny_engine_flags(tiny_model_dir), "--gpu-memory-utilization", "0.0001")
    assert (result.returncode, result.stdout) == (2, "")
    assert "Traceback" not in result.stderr
    [line] = message_lines(result.stderr)
    assert line.startswith("pdserve generate: KV cache too small: 0 blocks x 16 = 0 tokens (512 B/token) ")


def test_a_worker_with_a_missing_model_says_so_in_one_line_before_loading_anything(tmp_path):
    missing = tmp_path / "none.gguf"
    result = run_pdserve("prefill", "--model", str(missing))
    assert (result.returncode, result.stderr) == (
        2, f"pdserve prefill: model '{missing}' is neither a GGUF file nor a folder on this machine "
           "(pdserve loads local files only; it never downloads from a hub)\n")


def test_up_whose_worker_cannot_fit_one_request_prints_the_message_once(tiny_model_dir):
    # A share of free memory: only the worker knows its budget, so `up` cannot refuse it early.
    http_port, grpc_port = free_ports(2)
    result = run_pdserve("up", "--colocated", "--decode", "1", *tiny_engine_flags(tiny_model_dir),
                         "--gpu-memory-utilization", "0.0001", "--port", str(http_port),
                         "--grpc-port", str(grpc_port), "--drain-timeout", "5")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [line] = message_lines(result.stderr)
    assert line.startswith("pdserve decode: KV cache too small: 0 blocks x 16 = 0 tokens (512 B/token) ")
    assert "pdserve up: decode-0 exited with code 2 while starting" in result.stderr.splitlines()
