"""pdserve.preflight: the settings a process would refuse after loading its model, refused first:
engine settings from the model's header alone (the real default model's GGUF header; no weights
are read), ports with real sockets, Redis credentials from the environment."""

from __future__ import annotations

import socket

import pytest

from engine.capacity import KVCacheTooSmall, KVCapacity
from engine.config import EngineConfig
from pdserve.preflight import check_engine_settings, port_problem, redis_auth_problem


def test_the_cpu_default_budget_gives_the_workers_own_capacity():
    # 2 GiB / (46,080 bytes/token x 16) = 2,912 blocks: the worker's startup log line for float32.
    assert check_engine_settings(EngineConfig(dtype="float32")) == KVCapacity(2912, 16, 46080, 8192)


def test_a_block_count_override_is_the_capacity():
    config = EngineConfig(dtype="float32", num_gpu_blocks_override=600, max_model_len=4096)
    assert check_engine_settings(config) == KVCapacity(600, 16, 46080, 4096)


def test_a_share_of_free_memory_is_left_to_the_worker():
    assert check_engine_settings(EngineConfig(dtype="float32", gpu_memory_utilization=0.5)) is None


def test_a_kv_cache_too_small_for_one_request_is_refused_with_the_numbers():
    with pytest.raises(KVCacheTooSmall, match=r"^KV cache too small: 1 blocks x 16 = 16 tokens \(45 KiB/token\)"):
        check_engine_settings(EngineConfig(dtype="float32", kv_cache_memory=1 << 20))


def test_a_max_model_len_past_the_models_is_refused():
    with pytest.raises(ValueError, match=r"^max_model_len=100000 is longer than the model's context length \(8192\)$"):
        check_engine_settings(EngineConfig(dtype="float32", max_model_len=100_000))


def test_a_missing_model_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="is neither a GGUF file nor a folder on this machine"):
        check_engine_settings(EngineConfig(model=str(tmp_path / "none.gguf")))


def test_a_missing_tokenizer_is_refused(tmp_path):
    missing = tmp_path / "tok"
    with pytest.raises(FileNotFoundError) as caught:
        check_engine_settings(EngineConfig(dtype="float32", tokenizer=str(missing)))
    assert str(caught.value) == f"no tokenizer at {missing}: expected a .gguf file or a model folder"


def test_a_listening_port_is_named_with_its_flag():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert port_problem("127.0.0.1", [("--port", 0), ("--metrics-port", port)]) == (
            f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} (Address already in use); "
            "choose another --metrics-port")


def test_a_grpc_style_listener_with_so_reuseport_is_still_seen():
    # grpc servers set SO_REUSEPORT: a second one would share the port without an error.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert port_problem("127.0.0.1", [("--grpc-port", port)]).startswith(f"--grpc-port {port}: cannot listen")


def test_free_ports_and_port_zero_pass_and_one_port_twice_does_not():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert port_problem("127.0.0.1", [("--port", port), ("--grpc-port", 0), ("--metrics-port", 0)]) is None
    assert port_problem("127.0.0.1", [("--port", port), ("--grpc-port", port)]) == (
        f"--port and --grpc-port are both {port}")


def test_an_unreadable_redis_password_file_is_named(tmp_path, monkeypatch):
    missing = tmp_path / "redis.pass"
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD", raising=False)
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD_FILE", str(missing))
    assert redis_auth_problem() == (f"cannot read the Redis password file {missing} (PDSERVE_REDIS_PASSWORD_FILE): "
                                    f"[Errno 2] No such file or directory: '{missing}'")
    monkeypatch.delenv("PDSERVE_REDIS_PASSWORD_FILE")
    assert redis_auth_problem() is None
