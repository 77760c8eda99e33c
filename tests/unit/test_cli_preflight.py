"""What the real CLI checks before it starts anything: `pdserve up`'s ports and KV capacity, and
the server `pdserve bench` talks to. Each runs `python -m pdserve ...` as a user would."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]


def router_ports() -> list[str]:
    """--port and --grpc-port, two distinct free ports."""
    http, grpc = free_ports(2)
    return ["--port", str(http), "--grpc-port", str(grpc)]


def run_pdserve(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    return result, time.monotonic() - start


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port with a listener on 127.0.0.1 for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_up_refuses_a_taken_http_port_at_once_naming_the_flag(taken_port):
    result, seconds = run_pdserve("up", "--port", str(taken_port), "--grpc-port", str(free_port()))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (f"pdserve up: --port {taken_port}: cannot listen on 127.0.0.1:{taken_port} "
                             "(Address already in use); choose another --port\n")
    assert seconds < 10, "no model load, no Redis: the check comes first (measured ~0.3 s; loaded machine)"


def test_up_refuses_a_taken_grpc_port_naming_the_flag(taken_port):
    result, _ = run_pdserve("up", "--port", str(free_port()), "--grpc-port", str(taken_port))
    assert result.returncode == 1
    assert result.stderr == (f"pdserve up: --grpc-port {taken_port}: cannot listen on 127.0.0.1:{taken_port} "
                             "(Address already in use); choose another --grpc-port\n")


def test_up_refuses_one_port_for_http_and_grpc():
    port = free_port()
    result, _ = run_pdserve("up", "--port", str(port), "--grpc-port", str(port))
    assert (result.returncode, result.stderr) == (1, f"pdserve up: --port and --grpc-port are both {port}\n")


def test_up_takes_its_ports_from_a_config_file_and_checks_them(taken_port, tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text(f"port: {taken_port}\ngrpc-port: {free_port()}\nkv-cache-memory: 1GiB\n")
    result, _ = run_pdserve("up", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.startswith(f"pdserve up: --port {taken_port}: cannot listen on")


def test_up_refuses_a_kv_cache_that_cannot_hold_one_request_once_before_starting_anything():
    result, seconds = run_pdserve("up", "--kv-cache-memory", "1MiB", "--dtype", "bfloat16",
                                  *router_ports())
    assert (result.returncode, result.stdout) == (2, "")
    [line] = result.stderr.splitlines()
    assert line.startswith("pdserve up: KV cache too small: ")
    assert line.endswith("cannot hold one request of max_model_len=8,192 tokens, which needs 512 blocks "
                         "(180.0 MiB). Raise --kv-cache-memory / --gpu-memory-utilization / "
                         "--num-gpu-blocks-override, or lower --max-model-len to at most 32.")
    assert seconds < 30, "the model's header is read, not its weights (measured ~2 s)"


def test_up_refuses_a_model_that_is_not_there_before_starting_anything(tmp_path):
    missing = tmp_path / "none.gguf"
    result, _ = run_pdserve("up", "--model", str(missing), *router_ports())
    assert result.returncode == 2
    assert result.stderr == (f"pdserve up: model '{missing}' is neither a GGUF file nor a folder on this machine "
                             "(pdserve loads local files only; it never downloads from a hub)\n")


def test_bench_without_base_url_says_once_which_server_it_uses():
    port = free_port()  # nothing listens: every request fails fast, which is not what is tested
    result, _ = run_pdserve("bench", "--port", str(port), "--model", "m", "--num-prompts", "2",
                            "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm")
    lines = result.stdout.splitlines()
    assert lines[0] == f"Base URL: http://127.0.0.1:{port} (no --base-url: from --host and --port)"
    assert sum(line.startswith("Base URL") for line in lines) == 1


def test_bench_with_base_url_says_nothing_about_defaults():
    result, _ = run_pdserve("bench", "--base-url", f"http://127.0.0.1:{free_port()}/", "--model", "m",
                            "--num-prompts", "1", "--random-input-len", "8", "--random-output-len", "2",
                            "--disable-tqdm")
    assert result.stdout.splitlines()[0] == "Traffic request rate: inf"
    assert "Base URL" not in result.stdout


@pytest.mark.parametrize("command", ["up", "router", "decode", "prefill"])
def test_a_redis_url_without_a_scheme_is_refused_when_parsed(command):
    result, _ = run_pdserve(command, "--redis-url", "localhost:6379")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"pdserve {command}: error: argument --redis-url: not a Redis URL: 'localhost:6379' "
        "(redis://HOST:PORT/DB, rediss://... for TLS, or unix://PATH)")


def test_up_refuses_an_unknown_kv_transfer_backend_before_starting_workers():
    result, _ = run_pdserve("up", "--kv-transfer", "rdma", *router_ports())
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("pdserve up: error: argument --kv-transfer: invalid choice: 'rdma' "
                                              "(choose from 'cuda_ipc', 'gloo', 'local', 'nccl')")


def test_up_refuses_nccl_between_local_workers_that_would_share_one_gpu():
    result, seconds = run_pdserve("up", "--kv-transfer", "nccl", *router_ports())
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "pdserve up: --kv-transfer nccl needs a GPU per worker (NCCL takes one rank per device), "
        "and local workers all start on the same GPU, the first one visible: use --kv-transfer cuda_ipc "
        "for workers sharing a GPU, or --launcher ray / Kubernetes, where each worker has GPUs of its own")
    assert seconds < 10


def test_up_refuses_an_api_key_file_it_cannot_read_before_starting_anything(tmp_path, monkeypatch):
    missing = tmp_path / "api.key"
    monkeypatch.setenv("PDSERVE_API_KEY_FILE", str(missing))
    result, seconds = run_pdserve("up", *router_ports())
    assert (result.returncode, result.stderr) == (
        1, f"pdserve up: PDSERVE_API_KEY_FILE {missing}: cannot read it (No such file or directory)\n")
    assert seconds < 10


def test_up_refuses_an_empty_admin_key_file(tmp_path, monkeypatch):
    empty = tmp_path / "admin.key"
    empty.write_text("\n")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY_FILE", str(empty))
    result, _ = run_pdserve("up", *router_ports())
    assert (result.returncode, result.stderr) == (
        1, f"pdserve up: PDSERVE_ADMIN_KEY_FILE {empty} is empty: refusing to serve without the key it promises\n")


def test_the_router_says_in_one_line_that_its_api_key_file_is_missing(tmp_path, monkeypatch):
    missing = tmp_path / "api.key"
    monkeypatch.setenv("PDSERVE_API_KEY_FILE", str(missing))
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "x" * 32)
    result, _ = run_pdserve("router", "--port", "0", "--grpc-port", "0")
    assert (result.returncode, result.stderr) == (
        1, f"PDSERVE_API_KEY_FILE {missing}: cannot read it (No such file or directory)\n")


@pytest.mark.parametrize("command, flag", [("router", "--port"), ("router", "--grpc-port"), ("decode", "--port"),
                                           ("prefill", "--metrics-port")])
def test_a_component_refuses_a_taken_port_in_one_line_before_loading_anything(command, flag, taken_port,
                                                                             monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "x" * 32)
    others = {"router": ["--port", "0", "--grpc-port", "0"], "decode": [], "prefill": []}[command]
    result, seconds = run_pdserve(command, *others, flag, str(taken_port))
    assert (result.returncode, result.stderr) == (
        1, f"pdserve {command}: {flag} {taken_port}: cannot listen on 127.0.0.1:{taken_port} "
           f"(Address already in use); choose another {flag}\n")
    assert seconds < 20, "before torch, the model or the tokenizer loads (measured ~0.3 s)"


@pytest.mark.parametrize("command", ["up", "router", "decode"])
def test_an_unreadable_redis_password_file_is_one_line(command, tmp_path, monkeypatch):
    missing = tmp_path / "redis.pass"
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "x" * 32)
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD_FILE", str(missing))
    ports = router_ports() if command != "decode" else []
    result, _ = run_pdserve(command, "--redis-url", "redis://127.0.0.1:1/0", *ports)
    assert (result.returncode, result.stderr) == (
        1, f"pdserve {command}: cannot read the Redis password file {missing} (PDSERVE_REDIS_PASSWORD_FILE): "
           f"[Errno 2] No such file or directory: '{missing}'\n")


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback():
    result, _ = run_pdserve("plan", "--log-level", "loud")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("pdserve plan: error: argument --log-level: invalid choice: 'LOUD' "
                                              "(choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')")


def test_a_log_level_in_any_case_is_taken():
    from pdserve.cli import build_parser

    assert build_parser().parse_args(["plan", "--log-level", "debug"]).log_level == "DEBUG"
