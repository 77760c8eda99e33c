"""Redis locked down, on a real `pdserve up` (1 prefill + 1 decode, API key from the
environment): no secret on any command line; the embedded Redis wants its password and refuses
CONFIG/SAVE/DEBUG/FLUSHALL; a decode worker registered straight into Redis by someone holding
the password (but not the cluster secret) is never routed to; a SIGKILLed embedded Redis is
reaped and restarted on the same port, the workers re-register and requests go on."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest
import redis

from pdserve.redis_server import _resp, ping
from router.cluster.keys import WorkerInfo, signed_hash, worker_key, workers_set_key
from router.cluster.redis_settings import PASSWORD_ENV, RedisAuth, sync_client
from tests.e2e.cluster import start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "faults-api-key-0123456789"
CLUSTER = "default"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {"PDSERVE_API_KEY": API_KEY}
    drop = ("PDSERVE_CLUSTER_SECRET", "PDSERVE_CLUSTER_SECRET_FILE", PASSWORD_ENV)
    with mock.patch.dict(os.environ, env):
        for name in drop:
            os.environ.pop(name, None)  # restored by patch.dict: `pdserve up` generates both
        c = start_cluster(tmp_path_factory.mktemp("redis-lockdown"), "--prefill", "1", "--decode", "1",
                          "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "128MiB",
                          "--policy", "round_robin")
    try:
        yield c
    finally:
        c.stop()


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10).stdout
    children = [int(p) for p in out.split()]
    return children + [d for child in children for d in descendants(child)]


def cmdline(pid: int) -> bytes:
    """The process's argv, NUL-separated; b"" once it is gone (reaped since pgrep saw it)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def child_matching(cluster, pattern: bytes) -> int:
    pids = [p for p in descendants(cluster.process.pid) if pattern in cmdline(p)]
    assert len(pids) == 1, f"expected one child matching {pattern!r}, found {pids}"
    return pids[0]


def environ_of(pid: int) -> dict[str, str]:
    """A child's environment (same user): how the test learns the generated secrets."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def redis_port(cluster) -> int:
    match = re.search(r"redis redis://127\.0\.0\.1:(\d+)/0", cluster.log.read_text())
    assert match, cluster.log.read_text()[-2000:]
    return int(match.group(1))


def router_secrets(cluster) -> dict[str, str]:
    env = environ_of(child_matching(cluster, b"pdserve\0router"))
    return {name: env.get(name, "") for name in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_SECRET", PASSWORD_ENV)}


def password(cluster) -> str | None:
    return router_secrets(cluster)[PASSWORD_ENV] or None


def complete(cluster, prompt: str = "Hello") -> httpx.Response:
    return httpx.post(f"{cluster.base_url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def cluster_view(cluster) -> dict:
    response = httpx.get(f"{cluster.base_url}/v1/cluster", timeout=10,
                         headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


def test_no_secret_appears_on_any_command_line(cluster):
    secrets = router_secrets(cluster)
    assert secrets["PDSERVE_API_KEY"] == API_KEY
    assert len(secrets["PDSERVE_CLUSTER_SECRET"]) >= 43 and len(secrets[PASSWORD_ENV]) >= 43
    pids = [cluster.process.pid, *descendants(cluster.process.pid)]
    names = sorted(b" ".join(cmdline(p).split(b"\0")[2:4]).decode() for p in pids[1:])
    assert len(pids) == 5, names  # pdserve up, redis-server, 2 workers, router
    for pid in pids:
        line = cmdline(pid)
        assert b"--api-key" not in line
        for name, value in secrets.items():
            assert value.encode() not in line, f"{name} on the command line of {pid}: {line!r}"
    ps = subprocess.run(["ps", "-o", "args=", "-p", ",".join(map(str, pids))],
                        capture_output=True, text=True, timeout=10).stdout
    assert len(ps.splitlines()) == 5
    assert not any(value in ps for value in secrets.values())


def test_embedded_redis_wants_its_password_and_refuses_dangerous_commands(cluster):
    port = redis_port(cluster)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(_resp("HSET", worker_key(CLUSTER, "intruder"), "role", "decode"))
        assert sock.recv(256) == b"-NOAUTH Authentication required.\r\n"
    client = sync_client(f"redis://127.0.0.1:{port}/0", RedisAuth(password=password(cluster)))
    try:
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("SAVE",), ("DEBUG", "SLEEP", "0"), ("FLUSHALL",)):
            with pytest.raises(redis.ResponseError, match=f"unknown command `{command[0]}`"):
                client.execute_command(*command)
        assert client.exists(workers_set_key(CLUSTER)) == 1  # FLUSHALL did nothing
    finally:
        client.close()


class CountingListener:
    """A TCP port that counts the connections made to it: where the fake worker 'listens'."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connections(self) -> int:
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1


def test_a_decode_worker_written_into_redis_without_the_secret_gets_no_request(cluster):
    client = sync_client(f"redis://127.0.0.1:{redis_port(cluster)}/0",
                         RedisAuth(password=password(cluster)), decode_responses=True)
    listener = CountingListener()
    real = WorkerInfo.from_hash(client.hgetall(worker_key(CLUSTER, "decode-0")))
    fake = dataclasses.replace(real, worker_id="decode-fake", address=listener.address,
                               incarnation="attacker", free_blocks=real.total_blocks, reserved_blocks=0,
                               num_running=0, num_waiting=0, updated_at=time.time() + 600)
    guessed = dataclasses.replace(fake, worker_id="decode-guessed")
    try:
        client.hset(worker_key(CLUSTER, "decode-fake"), mapping=fake.to_hash())
        client.hset(worker_key(CLUSTER, "decode-guessed"),
                    mapping=signed_hash(guessed, CLUSTER, b"not-the-cluster-secret"))
        client.sadd(workers_set_key(CLUSTER), "decode-fake", "decode-guessed")
        time.sleep(0.5)  # several snapshot periods: a router that took the entry would use it
        statuses = [complete(cluster, f"Request {i}:").status_code for i in range(6)]
        listed = [w["worker_id"] for w in cluster_view(cluster)["workers"]]
    finally:
        client.delete(worker_key(CLUSTER, "decode-fake"), worker_key(CLUSTER, "decode-guessed"))
        client.srem(workers_set_key(CLUSTER), "decode-fake", "decode-guessed")
        client.close()
    assert statuses == [200] * 6
    assert sorted(listed) == ["decode-0", "prefill-0"]
    assert listener.connections() == 0


def test_a_killed_embedded_redis_comes_back_and_the_cluster_recovers(cluster):
    port, redis_password = redis_port(cluster), password(cluster)
    old_pid = child_matching(cluster, b"redis-server")
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pids = [p for p in descendants(cluster.process.pid) if b"redis-server" in cmdline(p)]
        if pids and pids != [old_pid] and ping("127.0.0.1", port, password=redis_password):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the embedded Redis did not come back on port {port}")
    came_back_s = 20 - (deadline - time.monotonic())
    back_at = time.monotonic()
    deadline = back_at + 30
    while time.monotonic() < deadline:
        view = cluster_view(cluster)
        if view["redis_ok"] and sorted(w["worker_id"] for w in view["workers"]) == ["decode-0", "prefill-0"]:
            break
        time.sleep(0.25)
    else:
        raise AssertionError(f"the workers did not re-register: {view}")
    registered_s = time.monotonic() - back_at
    assert [complete(cluster, f"After {i}").status_code for i in range(3)] == [200] * 3
    stats = subprocess.run(["ps", "-o", "stat=", "--ppid", str(cluster.process.pid)],
                           capture_output=True, text=True, timeout=10).stdout.split()
    assert len(stats) == 4 and not any(s.startswith("Z") for s in stats), stats
    print(f"embedded Redis back in {came_back_s:.1f} s; both workers listed again {registered_s:.1f} s later")
